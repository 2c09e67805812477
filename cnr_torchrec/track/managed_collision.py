"""Managed-collision (sort-zch) tables: the remapping state by table row, and the rows it changes.

A ``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection`` maps raw
ids onto a fixed table through one ``MCHManagedCollisionModule`` per table and rank. That module
keeps its state by *sort position*: ``_mch_sorted_raw_ids`` (the raw ids it holds, sorted, empty
slots holding int64's max), ``_mch_remapped_ids_mapping`` (the table row of each position) and the
eviction policy's metadata (``_mch_counts``, ``_mch_last_access_iter``), all re-sorted at every
eviction. Stored by position, one eviction would change every row after the first insert.

Here the same state is read and written by table row: row ``r`` holds raw id ``raw[r]`` (or none)
and its metadata. A delta then holds only the rows whose state changed, and a restore rebuilds the
sorted buffers exactly: the module sorts stably, so empty slots always lie in ascending row order
behind the raw ids, and the sorted buffers are a function of the by-row state.

What changes rows without a lookup: an eviction (every ``eviction_interval`` training steps).
It updates the metadata of the held ids seen in the window and gives the evicted slots new raw
ids; later in the same forward, the sharded module's ``_evict`` re-initialises those slots'
weights (torch's global RNG) and, for row-wise Adagrad, their momentum. :meth:`McTable.watch`
wraps the module's ``_update_and_evict`` and marks the rows whose by-row state differs after it:
the rows whose metadata changed, and among them every row ``_evict`` will re-initialise (a row
is re-initialised exactly when its raw id changed).

Between evictions, each rank's module also holds the eviction window's history (the raw ids seen
since the last eviction, with their metadata) and its iteration counters: :meth:`McTable.runtime`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cnr_torchrec.errors import UnsupportedShardingError
from cnr_torchrec.track.torchrec_types import TorchRecModule

__all__ = ["EMPTY", "McTable", "empty_state", "find_mc_tables", "inner_module", "route", "sort_order"]

log = logging.getLogger(__name__)

EMPTY = torch.iinfo(torch.int64).max  # the raw id of an empty slot, as the module writes it
MAX_HISTORY = 1 << 31  # eviction-window ids a restore allocates at most (16 GiB of int64)

Mark = Callable[[str, torch.Tensor], None]
"""Marks global rows of a table dirty: ``mark(table, global_rows)``."""


def inner_module(module: TorchRecModule) -> TorchRecModule | None:
    """The sharded EBC/EC inside a sharded managed-collision module, or None for any other module.

    Raises:
        UnsupportedShardingError: the module's tables are remapped by something other than sort-zch.
    """
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    if not isinstance(module, BaseShardedManagedCollisionEmbeddingCollection):
        return None
    for table, mch in module._managed_collision_collection._managed_collision_modules.items():
        if type(mch) is not MCHManagedCollisionModule:
            raise UnsupportedShardingError(
                f"table '{table}' is remapped by a {type(mch).__name__}; CheckNRunDMP checkpoints sort-zch tables "
                "(MCHManagedCollisionModule) only. MP-ZCH (HashZchManagedCollisionModule) keeps identities and "
                "metadata this library does not restore: use mc_type='sort-zch', or checkpoint this model with "
                "torch.distributed.checkpoint"
            )
    return module._embedding_module


def sort_order(state: torch.Tensor) -> torch.Tensor:
    """The rows of a by-row state (``[rows, fields]``, raw id first) in the order the module keeps its sorted
    buffers: raw ids ascending, empty slots after them in ascending row order (the module sorts stably)."""
    return torch.argsort(state[:, 0], stable=True)


def empty_state(rows: int, fields: int) -> torch.Tensor:
    """The by-row state of ``rows`` empty slots: no raw id, zero metadata."""
    state = torch.zeros(rows, fields, dtype=torch.int64)
    state[:, 0] = EMPTY
    return state


@dataclass
class McTable:
    """This rank's managed-collision module of one table, and its slots' place in the table.

    Attributes:
        table: the table's name.
        module: the sharded managed-collision module that holds it.
        mch: this rank's ``MCHManagedCollisionModule`` of the table.
        fields: the columns of the by-row state: ``raw_id``, then the policy's metadata names.
    """

    table: str
    # TorchRec's modules, whose buffers, policy and plan this class reads by name: typed Any, since nn.Module's
    # __getattr__ would type every one of them Tensor | Module.
    module: Any
    mch: Any

    @property
    def fields(self) -> tuple[str, ...]:
        return ("raw_id", *self.mch._mch_metadata)

    @property
    def start(self) -> int:
        """The global row of this rank's first slot."""
        return int(self.mch._output_global_offset)

    @property
    def num_rows(self) -> int:
        return int(self.mch._zch_size)

    @property
    def input_size(self) -> int:
        return int(self.mch._input_hash_size)

    @property
    def policy_name(self) -> str:
        """The class name of the module's eviction policy."""
        return type(self.mch._eviction_policy).__name__

    def keep_scores(self, state: torch.Tensor, current_iter: int) -> torch.Tensor | None:
        """The score the module's eviction policy gives each slot of ``state`` (by-row state, as :meth:`by_row`
        gives it; higher is kept) at iteration ``current_iter``; None for a policy this library cannot rank
        ids by (other than LFU, LRU and DistanceLFU)."""
        from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy

        policy = self.mch._eviction_policy
        col = {name: state[:, j].double() for j, name in enumerate(self.fields)}
        if isinstance(policy, DistanceLFU_EvictionPolicy):
            return col["counts"] / torch.pow(current_iter - col["last_access_iter"] + 1, policy._decay_exponent)
        if isinstance(policy, LRU_EvictionPolicy):
            return col["last_access_iter"]
        if isinstance(policy, LFU_EvictionPolicy):
            return col["counts"]
        return None

    # ---------------------------------------------------------------- by-row state

    def by_row(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """int64 ``[rows, len(fields)]``: the raw id (:data:`EMPTY` for none) and metadata of each slot,
        or of the slots ``rows`` (offsets into this rank's slots) only."""
        mch = self.mch
        position = torch.empty(self.num_rows, dtype=torch.int64, device=mch._mch_sorted_raw_ids.device)
        position[mch._mch_remapped_ids_mapping - self.start] = torch.arange(self.num_rows, device=position.device)
        if rows is not None:
            position = position[rows.to(position.device)]
        cols = [mch._mch_sorted_raw_ids, *mch._mch_metadata.values()]
        return torch.stack([c[position] for c in cols], dim=1).cpu()

    def load_by_row(self, state: torch.Tensor) -> None:
        """Rebuilds the sorted buffers from a by-row state (``[num_rows, len(fields)]``, as :meth:`by_row`)."""
        mch = self.mch
        state = state.to(mch._mch_sorted_raw_ids.device)
        order = sort_order(state)
        with torch.no_grad():
            mch._mch_sorted_raw_ids.copy_(state[order, 0])
            mch._mch_remapped_ids_mapping.copy_(order + self.start)
            for j, buf in enumerate(mch._mch_metadata.values(), start=1):
                buf.copy_(state[order, j])

    # ---------------------------------------------------------------- between evictions

    def runtime(self) -> dict[str, Any]:
        """What exact continuation needs beyond the by-row state: the eviction window's history and the
        iteration counters."""
        mch = self.mch
        n = int(mch._current_history_buffer_offset)
        size = int(mch._input_history_buffer_size)
        return {
            "current_iter": int(mch._current_iter),
            "iter_tensor": int(mch._current_iter_tensor.item()),
            "last_eviction_iter": int(mch._last_eviction_iter),
            "history_size": size,
            "history": (mch._history_accumulator[:n].cpu().clone() if size > 0
                        else torch.empty(0, dtype=torch.int64)),
            "history_metadata": {k: v[:n].cpu().clone() for k, v in mch._history_metadata.items()},
            "pending": (mch._evicted_emb_indices.cpu().clone().long() if mch._evicted
                        else torch.empty(0, dtype=torch.int64)),
            "evicted": bool(mch._evicted),
        }

    def check_runtime(self, state: Any) -> None:
        """Raises ValueError, saying what is wrong, unless ``state`` is a window :meth:`runtime` could have given
        for this module: its fields and types, a history no longer than its buffer with the policy's metadata
        beside each id, and counters as the module keeps them (``current_iter`` is -1 before the first step,
        else the iteration tensor's value, at most ``eviction_interval - 1`` past the last eviction)."""
        want = {"current_iter": int, "iter_tensor": int, "last_eviction_iter": int, "history_size": int,
                "history": torch.Tensor, "history_metadata": dict, "pending": torch.Tensor, "evicted": bool}
        if not isinstance(state, dict) or set(state) != set(want):
            raise ValueError(f"the eviction window must have the fields {sorted(want)}")
        for key, kind in want.items():
            if type(state[key]) is not kind:
                raise ValueError(f"{key} must be a {kind.__name__}, not {type(state[key]).__name__}")
        history, meta = state["history"], state["history_metadata"]
        n, size = history.numel(), state["history_size"]
        if history.dtype != torch.int64 or history.dim() != 1 or size < -1 or n > max(size, 0):
            raise ValueError(f"the history must be at most history_size ({size}) int64 ids, not {n} "
                             f"{history.dtype}")
        if size > MAX_HISTORY:
            raise ValueError(f"history_size {size} is past any buffer this library restores ({MAX_HISTORY} ids: a "
                             "module allocates its batch's ids x eviction_interval x 1.25)")
        names = {name for name, _, is_history in self.mch._eviction_policy.metadata_info if is_history}
        if set(meta) != names or any(not isinstance(v, torch.Tensor) or v.dtype != torch.int64 or v.shape != (n,)
                                     for v in meta.values()):
            raise ValueError(f"the history metadata must be {sorted(names)}, each an int64 value per id")
        it, current, last = state["iter_tensor"], state["current_iter"], state["last_eviction_iter"]
        interval = int(self.mch._eviction_interval)
        fresh = current == -1 and last == -1
        if it < 0 or not (fresh or (current == it and 0 <= current - last < interval)):
            raise ValueError(f"the counters (iteration {current}, tensor {it}, last eviction {last}) are not a "
                             f"module's with eviction interval {interval}")
        pending = state["pending"]
        if pending.dtype != torch.int64 or pending.dim() != 1 or (not state["evicted"] and pending.numel()) or (
                pending.numel() and not bool(((pending >= self.start) & (pending < self.start + self.num_rows)).all())):
            raise ValueError("the pending evictions must be int64 rows of this module's slots, and only when evicted")

    def load_runtime(self, state: dict[str, Any]) -> None:
        """Puts back what :meth:`runtime` returned (on the rank that saved it, or a history routed here);
        ``state`` must pass :meth:`check_runtime`."""
        self.check_runtime(state)
        mch = self.mch
        size = int(state["history_size"])
        history = state["history"]
        if size > 0:
            size = max(size, int(history.numel()))
            if int(mch._input_history_buffer_size) != size:
                self._allocate_history(size)
            n = int(history.numel())
            device = mch._history_accumulator.device
            mch._history_accumulator[:n] = history.to(device)
            for k, v in state["history_metadata"].items():
                mch._history_metadata[k][:n] = v.to(device)
            mch._current_history_buffer_offset = n
        mch._current_iter = int(state["current_iter"])
        mch._last_eviction_iter = int(state["last_eviction_iter"])
        with torch.no_grad():
            mch._current_iter_tensor.fill_(int(state["iter_tensor"]))
        mch._evicted = bool(state["evicted"])
        if mch._evicted:
            mch._evicted_emb_indices = state["pending"].to(mch._mch_sorted_raw_ids.device)

    # ---------------------------------------------------------------- a restore that fails

    _SCALARS = ("_current_iter", "_last_eviction_iter", "_current_history_buffer_offset", "_input_history_buffer_size",
                "_evicted")

    def capture(self) -> dict[str, Any]:
        """A copy of everything a restore may change in the module (buffers, history, counters), for
        :meth:`put_back`. Unlike :meth:`runtime` it is not a format: it never leaves the process."""
        mch = self.mch
        return {
            "buffers": {name: b.detach().clone() for name, b in mch.named_buffers(recurse=False)},
            "history": mch._history_accumulator.clone() if hasattr(mch, "_history_accumulator") else None,
            "pending": mch._evicted_emb_indices.clone(),
            "scalars": {name: getattr(mch, name) for name in self._SCALARS},
        }

    def put_back(self, captured: dict[str, Any]) -> None:
        """Makes the module what it was when :meth:`capture` gave ``captured``."""
        mch = self.mch
        with torch.no_grad():
            for name, saved in captured["buffers"].items():
                live = getattr(mch, name)
                if live.shape == saved.shape:
                    live.copy_(saved)
                    continue
                setattr(mch, name, saved.clone())  # a history buffer a restore re-allocated: the old size back
                if name.startswith("_history_"):
                    mch._history_metadata[name.removeprefix("_history_")] = getattr(mch, name)
        if captured["history"] is not None:
            mch._history_accumulator = captured["history"].clone()
        mch._evicted_emb_indices = captured["pending"].clone()
        for name, value in captured["scalars"].items():
            setattr(mch, name, value)

    def _allocate_history(self, size: int) -> None:
        """The history buffers as the module allocates them at its first training step, ``size`` long."""
        mch = self.mch
        device = mch._mch_sorted_raw_ids.device
        mch._input_history_buffer_size = size
        mch._history_accumulator = torch.empty(size, dtype=torch.int64, device=device)
        for name, is_mch, is_history in mch._eviction_policy.metadata_info:
            if is_history:
                mch.register_buffer(f"_history_{name}", torch.zeros(size, dtype=torch.int64, device=device),
                                    persistent=False)
                mch._history_metadata[name] = getattr(mch, f"_history_{name}")

    # ---------------------------------------------------------------- tracking

    def watch(self, mark: Mark) -> Callable[[], None]:
        """Marks (through ``mark``) the rows each eviction changes. Returns the undo."""
        mch = self.mch
        original = mch._update_and_evict

        def update_and_evict(*args: Any, **kwargs: Any) -> None:
            before = self.by_row()
            original(*args, **kwargs)
            changed = torch.nonzero((self.by_row() != before).any(dim=1)).view(-1)
            if changed.numel():
                mark(self.table, changed + self.start)

        mch._update_and_evict = update_and_evict
        return lambda: mch.__dict__.pop("_update_and_evict", None)


def find_mc_tables(dmp: TorchRecModule,
                   mark: Mark | None = None) -> tuple[dict[str, McTable], list[Callable[[], None]]]:
    """This rank's managed-collision tables of ``dmp``, by table; with ``mark``, their eviction paths watched
    (returns the undos too).

    Raises:
        UnsupportedShardingError: a table remapped by something other than sort-zch.
    """
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection

    tables: dict[str, McTable] = {}
    undo: list[Callable[[], None]] = []
    planned = set(dmp.plan.plan.keys())
    for fqn, module in dmp.module.named_modules():
        if fqn not in planned or not isinstance(module, BaseShardedManagedCollisionEmbeddingCollection):
            continue
        inner_module(module)  # refuses what is not sort-zch
        found = {t: McTable(t, module, mch)
                 for t, mch in module._managed_collision_collection._managed_collision_modules.items()}
        tables.update(found)
        if mark is not None:
            undo += [mc.watch(mark) for mc in found.values()]
    return tables, undo


def route(raw_ids: torch.Tensor, input_size: int, world_size: int, buckets: int | None = None, *,
          by_position: bool | None = None) -> torch.Tensor:
    """The rank TorchRec's row-wise input distribution sends each raw id to.

    TorchRec's sharded managed-collision collection builds one ``RwSparseFeaturesDist`` for its
    tables, passing each table's ``input_size()`` and ``buckets()``; its sharder rebuilds every
    module with ``buckets()`` equal to the table's number of row-wise shards, one per rank. The
    ids ``[0, buckets * block)`` are cut into ``buckets`` blocks of ``block = ceil(input_size /
    buckets)`` ids, and each rank takes a run of consecutive blocks: ``buckets // world_size``
    each, and one more for each of the first ``buckets % world_size`` ranks. An id past the last
    block (TorchRec does not check ids against ``input_size``) goes by its remainder: to
    ``(id % buckets) // (buckets // world_size)``, or, where some table of the distribution has a
    ``buckets`` that is not a multiple of the world size (``by_position``), to
    ``id % world_size``.

    Args:
        raw_ids: int64 raw ids, non-negative, as the module holds them (after its input hash).
        input_size: the module's ``input_size()``.
        world_size: the number of ranks the table is sharded over.
        buckets: the module's ``buckets()``; None for one per rank.
        by_position: whether any table sharing the input distribution has a ``buckets()`` that is
            not a multiple of ``world_size``; None for this table's own.

    Returns:
        int64, the rank of each id, shaped as ``raw_ids``.

    Raises:
        UnsupportedShardingError: fewer buckets than ranks, which TorchRec's input distribution
            refuses too.
    """
    buckets = world_size if buckets is None else int(buckets)
    if buckets < world_size:
        raise UnsupportedShardingError(
            f"a managed-collision module with buckets() {buckets} on {world_size} ranks: TorchRec's input "
            "distribution needs at least one bucket per rank. Shard the table over at most buckets() ranks")
    if by_position is None:
        by_position = buckets % world_size != 0
    block = -(-input_size // buckets)
    # The id each rank's run of blocks ends before; past int64 (an input size near it, TorchRec's default), none is.
    ends, end = [], 0
    for r in range(world_size):
        end += (buckets // world_size + (r < buckets % world_size)) * block
        ends.append(min(end, EMPTY))
    ranks = torch.searchsorted(torch.tensor(ends, dtype=torch.int64, device=raw_ids.device), raw_ids, right=True)
    past = raw_ids >= ends[-1]
    if by_position:
        beyond = raw_ids % world_size
    else:
        beyond = (raw_ids % buckets) // (buckets // world_size)
    return torch.where(past, beyond, ranks)
