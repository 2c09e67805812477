"""Dirty-row tracking at one bit per row, inside the FBGEMM TBE lookups of a DMP."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from cnr_torchrec import ops
from cnr_torchrec.errors import (
    ConfigError,
    MalformedLookupError,
    RowIdOutOfRangeError,
    TrackingNotEnabledError,
    UnknownTableError,
)
from cnr_torchrec.track._bounds import NO_CHECK, restore_configured_mode, takeover_mode, why_not_taken_over
from cnr_torchrec.track.discovery import ShardSlice, TrackedKernel, find_kernels, plan_table_shapes
from cnr_torchrec.track._inflight import InFlight, Lookup
from cnr_torchrec.track._sampling import sample_lookup

__all__ = ["DirtyRowTracker"]

log = logging.getLogger(__name__)

_COUNT_MODES = ("mfu", "ssu")


class _KernelState:
    """Bitmaps (and optional counters) of one TBE, in its flat row space."""

    # Variable-batch layouts whose B_offsets are kept on the device; a job has few.
    _MAX_BATCH_LAYOUTS = 64

    def __init__(self, info: TrackedKernel, device: torch.device, count_updates: bool, sync_free: bool) -> None:
        self.info = info
        self.sync_free = sync_free
        # Problems of this TBE's lookups (cnr::mark_rows' record). Sync-free, they stay
        # here until a query raises them; otherwise the hook raises them at once.
        self.errors = ops.lookup_record(device)
        # Whether the record was found clean with no lookup since: a save queries the tracker
        # many times, and each read of the record is a host sync on CUDA.
        self.checked = True
        # A record for the SSU pass, whose ids the first pass has already checked.
        self.sample_errors = ops.lookup_record(device) if sync_free else None
        words = ops.bitmap_words(info.num_rows)
        self.bitmap = torch.zeros(words, dtype=torch.int64, device=device)
        self.baseline: torch.Tensor | None = None
        self.counts = torch.zeros(info.num_rows, dtype=torch.int32, device=device) if count_updates else None
        # SSU: counters fed by a Bernoulli(rate) sample of the looked-up ids, drawn from a
        # generator of our own so that the training RNG stream is never touched.
        self.sample_rate: float | None = None
        self.generator: torch.Generator | None = None
        # Names of the tables behind each feature, for error messages only.
        ftm = getattr(info.tbe, "feature_table_map", None) or list(range(len(info.shards)))
        self.feature_tables = [info.shards[t].table for t in ftm]
        # FBGEMM's bounds-check mode of the TBE as configured, where the marking pass takes
        # that check over for the lookups it marks (see _bounds.py); None where it does not.
        self.fbgemm_bounds_check: int | None = None
        # Marked lookups whose update has not run yet, and the one the pre-hook just marked.
        self.in_flight = InFlight()
        self.marked: Lookup | None = None
        # The TBE's per-feature row layout, read once: the hook runs on every lookup.
        self.hash_size_cumsum = info.tbe.hash_size_cumsum
        self.rows_per_table = getattr(info.tbe, "rows_per_table", None)
        self._batch_offsets: dict[tuple[int, ...], torch.Tensor] = {}

    def mark(self, lookup: Lookup, counts: torch.Tensor | None = None, errors: torch.Tensor | None = None) -> None:
        """Marks the rows of ``lookup`` with the TBE's own row layout, recording its problems in ``errors``."""
        self.checked = False
        ops.mark_rows(lookup.indices, lookup.offsets, self.hash_size_cumsum, self.rows_per_table, self.bitmap, counts,
                      lookup.B_offsets, self.errors if errors is None else errors)

    def batch_offsets(self, bags_per_feature: tuple[int, ...]) -> torch.Tensor:
        """B_offsets of a variable-batch lookup, on the bitmap's device, made once per batch layout."""
        cached = self._batch_offsets.get(bags_per_feature)
        if cached is None:
            if len(self._batch_offsets) >= self._MAX_BATCH_LAYOUTS:
                self._batch_offsets.clear()
            host = torch.tensor([0, *itertools.accumulate(bags_per_feature)], dtype=torch.int64)
            if self.bitmap.is_cuda:
                host = host.pin_memory()  # so that the copy does not wait for the stream
            cached = self._batch_offsets[bags_per_feature] = host.to(self.bitmap.device, non_blocking=True)
        return cached


class DirtyRowTracker:
    """Records which embedding rows each training step looks up, per shard, at 1 bit per row.

    A forward pre-hook on every TBE (``kernel.emb_module``) passes the lookup's
    ``indices``/``offsets`` to ``torch.ops.cnr.mark_rows``, with the TBE's own
    per-feature ``hash_size_cumsum`` and ``rows_per_table`` (so features that share a
    table mark the same rows). Under the fused optimizers FBGEMM supports, the rows a
    step changes are a subset of the rows it looks up, so the bitmap is exactly what a
    differential checkpoint must save. A lookup whose backward (and so its update) has
    not run yet stays dirty across :meth:`reset` (see ``_inflight.py``), so pipelines
    that look up the next batch before the current one's update lose nothing.

    That pass reads every id and bag offset the lookup will read, and rejects any id
    outside its table (RowIdOutOfRangeError) and any offsets that are negative,
    decrease or run past the ids (MalformedLookupError). On CPU it raises before the
    lookup runs. It is therefore a complete bounds check, so on CPU the TBE's own pass
    (``bounds_check_indices``, which costs about three times as much) is skipped for
    the lookups the tracker marks, unless the user chose a mode or passed
    ``fuse_bounds_check=False`` (see ``_bounds.py``): the hook sets
    ``bounds_check_mode_int`` to NONE for those calls and restores the configured mode
    for the others (eval, no-grad) and on :meth:`remove`. In training this is stricter
    than FBGEMM's default WARNING mode, which would replace a bad id by row 0 and go on.

    Sync-free tracking (the default for TBEs on CUDA) never makes the host wait in a
    training step: the pass records its problems on the device, and the next query
    (:meth:`dirty_rows`, :meth:`dirty_counts`, ..., or :meth:`check_lookups`) raises
    the first of them, with the same errors; FBGEMM keeps its own bounds check then,
    since a recorded problem cannot stop the lookup it was found in. SSU draws its
    sample as a mask on the device. Device copies of variable-batch offsets are
    cached per batch layout.

    Two views are kept:

    * "since reset": rows looked up since the last :meth:`reset` (consecutive deltas);
    * "since baseline": rows looked up since the last ``reset(baseline=True)``
      (one-shot deltas), kept only with ``baseline_view=True``. Each :meth:`reset`
      ORs the first view into a second bitmap, so it costs one more bit per row
      and never a second pass over the ids.

    data_parallel tables report every row as dirty: a dense optimizer may change any row.

    Optional int32 counters per row (:meth:`enable_counting`) rank dirty rows for CPR's
    budget-limited saves: MFU counts every lookup, SSU a sample of them. A budget-limited
    save clears only the rows it wrote (``reset(keep=...)``); the rest stay dirty.

    Args:
        dmp: the sharded model (a DistributedModelParallel).
        count_updates: also keep an int32 lookup counter per row (32 more bits per row),
            counting every lookup (MFU); the same as ``enable_counting("mfu")``.
        baseline_view: allocate the "since baseline" view from the start.
        fuse_bounds_check: let the marking pass stand in for FBGEMM's bounds check on CPU
            where the user left FBGEMM's mode at its default.
        sync_free: keep host syncs out of the training step (see above); None (the
            default) turns it on for TBEs on CUDA and off for TBEs on CPU.

    Raises:
        UnsupportedShardingError: a table is not on an FBGEMM TBE with a fused optimizer,
            or sits in a managed-collision module.
    """

    def __init__(
        self,
        dmp: nn.Module,
        *,
        count_updates: bool = False,
        baseline_view: bool = False,
        fuse_bounds_check: bool = True,
        sync_free: bool | None = None,
    ) -> None:
        self._plan_tables = plan_table_shapes(dmp)
        self._kernels: list[_KernelState] = []
        self._shards: dict[str, list[tuple[_KernelState, ShardSlice]]] = {t: [] for t in self._plan_tables}
        self._num_embeddings: dict[str, int] = {}
        self._dims: dict[str, int] = {}
        self._handles = []
        plan_modes = {t: e["bounds_check_mode"] for t, e in self._plan_tables.items()}
        for info in find_kernels(dmp):
            # Bitmaps live where the TBE keeps its row offsets, so the hook never copies.
            device = info.tbe.hash_size_cumsum.device
            state = _KernelState(info, device, count_updates, device.type == "cuda" if sync_free is None else sync_free)
            if baseline_view:
                state.baseline = torch.zeros_like(state.bitmap)
            self._kernels.append(state)
            for cfg, shard in zip(info.kernel.config.embedding_tables, info.shards):
                self._shards[shard.table].append((state, shard))
                self._num_embeddings[shard.table] = int(cfg.num_embeddings)
                self._dims[shard.table] = int(cfg.embedding_dim)
            if info.data_parallel:
                continue
            reason = why_not_taken_over(info, plan_modes, fuse_bounds_check, state.sync_free)
            if reason is None:
                state.fbgemm_bounds_check = takeover_mode(info)
            else:
                restore_configured_mode(info)  # in case an earlier tracker of this model left NONE set
                log.debug("FBGEMM keeps the bounds check of %s: %s", self._tables_of(state), reason)
            tbe = info.tbe
            self._handles.append(tbe.register_forward_pre_hook(self._make_hook(state), with_kwargs=True))
            self._handles.append(tbe.register_forward_hook(self._make_post_hook(state)))

    @property
    def sync_free(self) -> bool:
        """Whether any TBE of this rank is tracked sync-free (its lookup problems raised by queries)."""
        return any(k.sync_free for k in self._kernels)

    @property
    def fused_bounds_check(self) -> bool:
        """Whether the marking pass stands in for FBGEMM's bounds check on any TBE of this rank."""
        return any(k.fbgemm_bounds_check is not None for k in self._kernels)

    # ------------------------------------------------------------------ hook

    def _make_hook(self, state: _KernelState):
        fbgemm_mode = state.fbgemm_bounds_check

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            state.marked = None
            if not (module.training and torch.is_grad_enabled()):
                if fbgemm_mode is not None:
                    module.bounds_check_mode_int = fbgemm_mode  # a lookup we do not check: FBGEMM does
                return
            lookup = self._lookup_of(state, args, kwargs)
            # Read at call time: counters may be enabled after the hook was registered.
            counts, rate = state.counts, state.sample_rate
            sampled = counts is not None and rate is not None and rate < 1.0  # rate 1: count all, in one pass
            state.mark(lookup, None if sampled else counts)
            if not state.sync_free:
                self._raise_recorded(state, clear=True)  # before the lookup runs
            if fbgemm_mode is not None:
                # Every id and offset the lookup reads passed the checks above.
                module.bounds_check_mode_int = NO_CHECK
            if sampled:
                # The sample's rows are already set in the bitmap, so this pass only bumps counters
                # (re-setting a set bit changes nothing); its ids went through the checks above.
                kept, kept_offsets = sample_lookup(lookup.indices, lookup.offsets, rate, state.generator,
                                                   sync_free=state.sync_free)
                state.mark(Lookup(kept, kept_offsets, lookup.B_offsets), counts, state.sample_errors)
            state.marked = lookup

        return hook

    @staticmethod
    def _make_post_hook(state: _KernelState):
        def post_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if state.marked is not None:
                state.in_flight.add(state.marked, output)
                state.marked = None

        return post_hook

    def _lookup_of(self, state: _KernelState, args: tuple, kwargs: dict) -> Lookup:
        indices = kwargs["indices"] if "indices" in kwargs else args[0]
        offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
        weights = kwargs["per_sample_weights"] if "per_sample_weights" in kwargs else \
            (args[2] if len(args) > 2 else None)
        if weights is not None and weights.numel() != indices.numel():
            raise MalformedLookupError(
                f"a lookup of {self._tables_of(state)} has {weights.numel()} per-sample weights for "
                f"{indices.numel()} ids; give one weight per id"
            )
        vbe = kwargs.get("batch_size_per_feature_per_rank")
        b_offsets = None if vbe is None else state.batch_offsets(tuple(sum(b) for b in vbe))
        return Lookup(indices, offsets, b_offsets)

    @staticmethod
    def _tables_of(state: _KernelState) -> str:
        return ", ".join(f"'{t}'" for t in dict.fromkeys(state.feature_tables))

    def _raise_recorded(self, state: _KernelState, *, clear: bool) -> None:
        """Raises the first problem recorded for ``state``'s lookups, as a tracker error."""
        try:
            ops.raise_lookup_errors(state.errors)  # on CUDA, a read on the host
        except (IndexError, ValueError, RuntimeError) as e:
            record = state.errors.to("cpu", copy=True)
            if clear:
                state.errors.zero_()
            raise self._lookup_error(state, record, e) from e

    def _lookup_error(self, state: _KernelState, record: torch.Tensor, error: Exception) -> Exception:
        bad = ops.first_bad_id(record) if isinstance(error, IndexError) else None
        if bad is not None:
            feature, bad_id, rows, count = bad
            since = " since tracking began" if state.sync_free else " in the batch"
            return RowIdOutOfRangeError(
                f"table '{state.feature_tables[feature]}' was looked up with id {bad_id}, outside the {rows} rows "
                f"this shard holds ({count} bad ids{since}); check that the input ids are below the table's "
                "num_embeddings"
            )
        return MalformedLookupError(
            f"a lookup of {self._tables_of(state)} has a bad bag layout: {error}; offsets must start at 0 or "
            "more, never decrease, and end within the ids"
        )

    def check_lookups(self, table: str | None = None) -> None:
        """Raises the first bad lookup that sync-free tracking recorded (see the class docs).

        Every query calls it, so a bad id or bag layout surfaces at the next save at the
        latest. A problem stays recorded: the lookup it was found in has run, so the rows
        tracked since can no longer be vouched for. On CUDA this reads on the host.

        Args:
            table: check only the TBEs that hold ``table`` (default: every TBE).

        Raises:
            RowIdOutOfRangeError: a lookup had an id outside its table.
            MalformedLookupError: a lookup had a bad bag layout.
        """
        states = self._kernels if table is None else dict.fromkeys(k for k, _ in self._shards[table])
        for state in states:
            if state.sync_free and not state.checked:
                self._raise_recorded(state, clear=False)
                state.checked = True

    # ------------------------------------------------------------------ queries

    def tables(self) -> list[str]:
        """Names of every embedding table of the model, as in its table configs."""
        return list(self._plan_tables)

    def tbes(self) -> list[nn.Module]:
        """Every TBE this rank runs (sharded and data_parallel)."""
        return [k.info.tbe for k in self._kernels]

    def module_fqns(self) -> list[str]:
        """Fully qualified names of the sharded embedding modules, as in the plan."""
        return sorted({str(e["module"]) for e in self._plan_tables.values()})

    def sharding_type(self, table: str) -> str:
        """The sharding type of ``table`` in the plan (``"row_wise"``, ``"data_parallel"``, ...)."""
        return str(self._entry(table)["sharding_type"])

    def is_data_parallel(self, table: str) -> bool:
        """Whether ``table`` is replicated (data_parallel) rather than sharded."""
        return self.sharding_type(table) == "data_parallel"

    def shard_ranges(self, table: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """This rank's ``((row_start, row_end), (col_start, col_end))`` for each shard of ``table``."""
        self._entry(table)
        return [(s.rows, s.cols) for _, s in self._shards[table]]

    def shards(self, table: str) -> list[tuple[TrackedKernel, ShardSlice]]:
        """This rank's shards of ``table``, with the TBE that holds each."""
        self._entry(table)
        return [(state.info, s) for state, s in self._shards[table]]

    def table_module(self, table: str) -> str:
        """The name of the sharded module that holds ``table`` in the model (``"sparse.ebc"``).

        Raises:
            UnknownTableError: the model has no table of that name.
        """
        return str(self._entry(table)["module"])

    def table_shape(self, table: str) -> tuple[int, int] | None:
        """``(num_embeddings, embedding_dim)`` of the whole table, or None if this rank holds none of it."""
        self._entry(table)
        if table not in self._num_embeddings:
            return None
        return self._num_embeddings[table], self._dims[table]

    def shard_dirty_rows(
        self, table: str, *, since_baseline: bool = False
    ) -> list[tuple[TrackedKernel, ShardSlice, torch.Tensor]]:
        """Per shard of ``table`` on this rank: the dirty rows as offsets into the shard (int64, CPU)."""
        self._entry(table)
        self.check_lookups(table)
        return [
            (state.info, s, self._shard_rows(state, s, since_baseline) - s.rows[0]) for state, s in self._shards[table]
        ]

    def dirty_rows(self, table: str, *, since_baseline: bool = False) -> torch.Tensor:
        """Sorted, unique global ids of this rank's rows of ``table`` looked up in training.

        Args:
            table: table name.
            since_baseline: count from the last ``reset(baseline=True)`` instead of
                the last :meth:`reset`.

        Returns:
            int64 tensor on CPU. For column_wise tables, the rows of this rank's
            column shards; for data_parallel tables, every row.

        Raises:
            UnknownTableError: no such table.
            RowIdOutOfRangeError, MalformedLookupError: a bad lookup recorded by
                sync-free tracking (see :meth:`check_lookups`).
        """
        self._entry(table)
        self.check_lookups(table)
        parts = [self._shard_rows(state, s, since_baseline) for state, s in self._shards[table]]
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        if len(parts) == 1:
            return parts[0]
        return torch.unique(torch.cat(parts), sorted=True)

    def dirty_counts(self, *, since_baseline: bool = False) -> dict[str, int]:
        """Number of dirty rows of each table on this rank (column shards of a table counted once)."""
        self.check_lookups()
        return {t: self._count(t, since_baseline) for t in self._plan_tables}

    def update_counts(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row lookup counters of this rank's rows of ``table`` (needs ``count_updates=True``).

        Returns:
            (global row ids, int32 counts) over every row this rank holds of ``table``.
        """
        self._entry(table)
        rows, counts = [], []
        for state, s in self._shards[table]:
            if state.counts is None:
                raise TrackingNotEnabledError(
                    "lookup counters are off: construct the tracker with count_updates=True or call enable_counting()"
                )
            rows.append(torch.arange(s.rows[0], s.rows[1], dtype=torch.int64))
            counts.append(state.counts[s.flat_start : s.flat_start + s.num_rows].cpu())
        if not rows:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)
        return torch.cat(rows), torch.cat(counts)

    def shard_update_counts(self, table: str) -> list[tuple[TrackedKernel, ShardSlice, torch.Tensor]]:
        """Per shard of ``table`` on this rank: its int32 counters, one per shard row, where they live.

        The tensors are views of the live counters (no copy); index them with the offsets
        :meth:`shard_dirty_rows` returns. data_parallel shards have no counters and are left out.

        Raises:
            TrackingNotEnabledError: counters are off (see :meth:`enable_counting`).
        """
        self._entry(table)
        out = []
        for state, s in self._shards[table]:
            if state.info.data_parallel:
                continue
            if state.counts is None:
                raise TrackingNotEnabledError(
                    "lookup counters are off: construct the tracker with count_updates=True or call enable_counting()"
                )
            out.append((state.info, s, state.counts[s.flat_start : s.flat_start + s.num_rows]))
        return out

    @property
    def counting(self) -> str | None:
        """``"mfu"`` (every lookup counted), ``"ssu"`` (a sample counted) or None (no counters)."""
        kernels = [k for k in self._kernels if not k.info.data_parallel]
        if not kernels or kernels[0].counts is None:
            return None
        return "mfu" if kernels[0].sample_rate is None else "ssu"

    @property
    def bits_per_row(self) -> float:
        """Tracking state held per embedding row on this rank, in bits."""
        rows = sum(k.info.num_rows for k in self._kernels if not k.info.data_parallel)
        if rows == 0:
            return 0.0
        bits = 0
        for k in self._kernels:
            if k.info.data_parallel:
                continue
            bits += k.bitmap.numel() * 64
            bits += 0 if k.baseline is None else k.baseline.numel() * 64
            bits += 0 if k.counts is None else k.counts.numel() * 32
        return bits / rows

    # ------------------------------------------------------------------ updates

    def reset(self, *, baseline: bool = False, keep: Mapping[str, torch.Tensor] | None = None) -> None:
        """Starts a new tracking interval.

        Lookups whose update is still to come (in flight) stay dirty in the new interval.

        Args:
            baseline: also restart the "since baseline" view (a full checkpoint was
                just taken). Otherwise the interval's rows are folded into that view.
            keep: per table, global row ids that stay dirty, with their counters, because
                a budget-limited save left them out: a later save must still write them.
                Rows of a table that this rank does not hold are ignored; every other row
                is cleared and its counter zeroed.

        Raises:
            UnknownTableError: ``keep`` names a table the model does not have.
        """
        kept = self._kept_flat_rows(keep or {})
        for k in self._kernels:
            rows = kept.get(id(k))
            saved = None
            if rows is not None and k.counts is not None:
                saved = k.counts.index_select(0, rows)
            if k.baseline is not None:
                if baseline:
                    k.baseline.zero_()
                else:
                    # Kept rows are folded in too: the view is ``baseline | bitmap``, so either way they are in it.
                    k.baseline.bitwise_or_(k.bitmap)
            k.bitmap.zero_()
            if k.counts is not None:
                k.counts.zero_()
            if rows is not None:
                # Re-mark the kept rows as one feature over the TBE's whole flat row space.
                offsets = torch.tensor([0, rows.numel()], dtype=torch.int64, device=k.bitmap.device)
                space = torch.tensor([0, k.info.num_rows], dtype=torch.int64, device=k.bitmap.device)
                ops.mark_rows(rows, offsets, space, space[1:], k.bitmap)
                if saved is not None:
                    k.counts.index_copy_(0, rows, saved)
            for lookup in k.in_flight:
                # Looked up but not yet updated: the update lands in the new interval.
                k.mark(lookup)

    def enable_counting(self, mode: str, rate: float = 1.0, seed: int = 0) -> None:
        """Starts per-row lookup counters (int32, 32 bits per row) for priority-ordered saves.

        Counters start at zero; rows looked up before this call are dirty but uncounted.
        The dirty bitmap stays exact in either mode.

        Args:
            mode: ``"mfu"`` counts every looked-up id. ``"ssu"`` counts a Bernoulli(``rate``)
                sample of them, drawn per looked-up id from a generator of this tracker's
                own (seeded from ``seed`` and the rank; the global RNG is never used).
            rate: SSU's sampling rate, in (0, 1]; ignored for MFU.
            seed: SSU's seed; ranks and TBEs derive distinct streams from it.

        Raises:
            ConfigError: unknown mode or a rate outside (0, 1].
        """
        if mode not in _COUNT_MODES:
            raise ConfigError(f"counting mode {mode!r} is not one of {list(_COUNT_MODES)}")
        if mode == "ssu" and not (isinstance(rate, (int, float)) and 0.0 < rate <= 1.0):
            raise ConfigError(f"ssu rate must be in (0, 1], got {rate!r}")
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        for i, k in enumerate(self._kernels):
            if k.counts is None:  # data_parallel TBEs too, as with count_updates=True (they stay at zero)
                k.counts = torch.zeros(k.info.num_rows, dtype=torch.int32, device=k.bitmap.device)
            if mode == "mfu" or k.info.data_parallel:
                k.sample_rate, k.generator = None, None
                continue
            k.sample_rate = float(rate)
            k.generator = torch.Generator(device=k.bitmap.device)
            # Distinct, reproducible streams per (seed, rank, TBE).
            k.generator.manual_seed(((int(seed) * 1_000_003 + rank) * 1_009 + i) % 2**63)
        log.info("lookup counters on (%s%s)", mode, f", rate {rate}" if mode == "ssu" else "")

    def enable_baseline_view(self) -> None:
        """Starts keeping the "since baseline" view, if it is not kept already.

        A new view starts empty: rows looked up before this call are not in it, so
        take a baseline (``reset(baseline=True)``) before relying on it.
        """
        for k in self._kernels:
            if k.baseline is None:
                k.baseline = torch.zeros_like(k.bitmap)

    @property
    def has_baseline_view(self) -> bool:
        return all(k.baseline is not None for k in self._kernels)

    def remove(self) -> None:
        """Detaches the hooks, and gives the TBEs back their configured bounds checks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for k in self._kernels:
            if k.fbgemm_bounds_check is not None:
                k.info.tbe.bounds_check_mode_int = k.fbgemm_bounds_check
                k.fbgemm_bounds_check = None

    # ------------------------------------------------------------------ internals

    def _kept_flat_rows(self, keep: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``keep`` (global rows per table) as flat TBE rows, per kernel state (keyed by id())."""
        parts: dict[int, list[torch.Tensor]] = {}
        for table, rows in keep.items():
            self._entry(table)
            rows = torch.as_tensor(rows, dtype=torch.int64).cpu()
            for state, s in self._shards[table]:
                if state.info.data_parallel or rows.numel() == 0:
                    continue
                mine = rows[(rows >= s.rows[0]) & (rows < s.rows[1])]
                parts.setdefault(id(state), []).append(mine + (s.flat_start - s.rows[0]))
        out = {}
        for k in self._kernels:
            if id(k) in parts:
                out[id(k)] = torch.unique(torch.cat(parts[id(k)])).to(k.bitmap.device)
        return out

    def _entry(self, table: str) -> dict[str, object]:
        try:
            return self._plan_tables[table]
        except KeyError:
            raise UnknownTableError(
                f"no embedding table named '{table}'; the model has {sorted(self._plan_tables)}"
            ) from None

    def _view(self, state: _KernelState, since_baseline: bool) -> torch.Tensor:
        if not since_baseline:
            return state.bitmap
        if state.baseline is None:
            raise TrackingNotEnabledError(
                "construct the tracker with baseline_view=True to query rows dirty since the baseline"
            )
        return state.baseline | state.bitmap

    def _shard_rows(self, state: _KernelState, s: ShardSlice, since_baseline: bool) -> torch.Tensor:
        if state.info.data_parallel:
            return torch.arange(s.rows[0], s.rows[1], dtype=torch.int64)
        bits = self._view(state, since_baseline)
        local = ops.bitmap_to_rows(bits, s.flat_start, s.flat_start + s.num_rows).cpu()
        return local + (s.rows[0] - s.flat_start)

    def _count(self, table: str, since_baseline: bool) -> int:
        shards = self._shards[table]
        if not shards:
            return 0
        if len(shards) > 1:  # column shards of one table: count the union once
            return int(self.dirty_rows(table, since_baseline=since_baseline).numel())
        state, s = shards[0]
        if state.info.data_parallel:
            return s.num_rows
        bounds = torch.tensor([s.flat_start, s.flat_start + s.num_rows], dtype=torch.int64)
        return int(ops.bitmap_count(self._view(state, since_baseline), bounds)[0])
