"""The blocking half of a save: ``stage``, on the training thread.

``stage`` copies what the decision asks for into host memory that training will not
touch again: dirty weight and optimizer-state rows of every local shard (with the
managed-collision state of a sort-zch table's rows), and on rank 0
the replicated state (data_parallel tables, dense parameters, the dense optimizer). It
is the only part of a save that stalls training besides the planner's all-gather.
:mod:`~cnr_torchrec.ckpt.save.writer` encodes and writes what it staged, in the background.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cnr_torchrec.ckpt.config import BudgetConfig
from cnr_torchrec.ckpt.job_state import JobState
from cnr_torchrec.ckpt.live.dense_optim import state_to_save
from cnr_torchrec.ckpt.live.dense_params import dense_named_state
from cnr_torchrec.ckpt.live.rng import rng_state
from cnr_torchrec.ckpt.save.planner import Decision
from cnr_torchrec.ckpt.save.priority import choose_rows, gather_column_counts
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.track.tbe_cache import flush_caches

__all__ = ["Staged", "StagedShard", "StagingBuffers", "stage"]

log = logging.getLogger(__name__)


@dataclass
class StagedShard:
    """Rows of one local shard, copied to host.

    ``ids`` are offsets into the shard (None when the shard is written whole).
    ``states`` are the fused optimizer's per-row states, each with a flag saying whether
    it holds one value per row (rowwise) or one per column. ``mc``: a managed-collision
    table's by-row state of the same rows (int64, its columns named by ``mc_fields``).
    """

    table: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    encoding: str
    ids: torch.Tensor | None
    weights: torch.Tensor
    states: list[tuple[torch.Tensor, bool]]
    mc: torch.Tensor | None = None
    mc_fields: tuple[str, ...] = ()


@dataclass
class Staged:
    decision: Decision
    rank: int
    world_size: int
    shards: list[StagedShard] = field(default_factory=list)
    replicated_tables: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    dense_optimizer: dict[str, Any] | None = None  # its saved form (format/dense_optim.py), rank 0's
    extra: dict[str, Any] = field(default_factory=dict)
    rng: Any = None
    mc_runtime: dict[str, Any] = field(default_factory=dict)
    tbe_iter: int = 0
    table_shapes: dict[str, list[int]] = field(default_factory=dict)
    stall_ms: float = 0.0
    # Per table, global rows a budget-limited delta left out: they stay dirty for a later save.
    left_out: dict[str, torch.Tensor] = field(default_factory=dict)
    # The StagingBuffers this save holds, given back once it is written.
    buffers: list = field(default_factory=list)


class StagingBuffers:
    """Host buffers kept from save to save, one per shard and state, so that staging copies into
    memory that is already mapped instead of faulting in fresh pages (pinned when the model is on
    an accelerator). A save takes its buffers and gives them back once written; a save that
    stages while another still holds a buffer gets a fresh one. A rank keeps the largest
    save's staged bytes (its first baseline's, under consecutive) between saves.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], torch.Tensor] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple[Any, ...], like: torch.Tensor, rows: int, taken: list) -> torch.Tensor:
        """``rows`` rows shaped and typed like ``like``, on the host, for the save whose list is ``taken``.

        A new buffer holds all of ``like``'s rows: its pages are mapped only as rows are written, and the
        next save that needs more rows finds them there.
        """
        with self._lock:
            buf = self._free.pop(key, None)
        if buf is None or buf.dtype != like.dtype or buf.shape[1:] != like.shape[1:] or buf.shape[0] < rows:
            buf = torch.empty((max(rows, like.shape[0]), *like.shape[1:]), dtype=like.dtype,
                              pin_memory=like.device.type != "cpu")
        taken.append((key, buf))
        return buf[:rows]

    def give_back(self, taken: list) -> None:
        with self._lock:
            for key, buf in taken:
                self._free[key] = buf
        taken.clear()


def _host_copy(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of ``t`` that training never writes: into ``out`` if given, else a new tensor (pinned when
    ``t`` is on an accelerator)."""
    if out is None:
        if t.device.type == "cpu":
            return t.detach().clone(memory_format=torch.contiguous_format)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t.detach(), non_blocking=t.device.type != "cpu")
    return out


def _gather_rows(t: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` of ``t`` in host memory (into ``out`` if given): one gather on the host, a gather then a
    pinned copy elsewhere."""
    if t.device.type == "cpu":
        if out is None:
            return t.detach().index_select(0, rows)
        return torch.index_select(t.detach(), 0, rows, out=out)
    return _host_copy(t.detach().index_select(0, rows), out)


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def is_rowwise(state: torch.Tensor, num_rows: int) -> bool:
    """Whether a shard's optimizer state holds one value per row (row-wise Adagrad's), not one per weight."""
    return state.dim() == 1 or state.numel() == num_rows


def _tbe_views(tbe: Any, views: dict[int, tuple[Any, Any]]) -> tuple[Any, Any]:
    """A TBE's per-table weight and optimizer-state views, asked for once per save."""
    if id(tbe) not in views:
        states = tbe.split_optimizer_states() if hasattr(tbe, "split_optimizer_states") else []
        views[id(tbe)] = (tbe.split_embedding_weights(), states)
    return views[id(tbe)]


def stage(
    decision: Decision,
    job: JobState,
    *,
    rank: int,
    world_size: int,
    budget: BudgetConfig | None = None,
    buffers: StagingBuffers | None = None,
) -> Staged:
    """Copies everything ``decision`` saves of ``job`` into host memory. Blocks training.

    With ``budget.max_rows_fraction`` set, a delta writes at most
    ``ceil(max_rows_fraction * rows)`` rows of each shard: the dirty rows with the highest
    lookup counts (CPR's MFU/SSU), as ids even where the decision said ``full``. The
    rows left out are returned in ``Staged.left_out`` and must stay dirty
    (``tracker.reset(keep=staged.left_out)``). Baselines are never limited. With SSU and
    column-split tables on several ranks this is collective (every rank calls it).

    Raises:
        ConfigError: a budget on a one-shot delta (restored from the baseline and the latest
            delta alone, a row left out would fall back to its baseline value).
    """
    t0 = time.perf_counter()
    tracker = job.tracker
    out = Staged(decision, rank, world_size)
    limited = _budget_applies(decision, budget)
    column_counts = gather_column_counts(tracker, budget.priority, world_size) if budget is not None and limited else {}
    flush_caches(tracker.tbes())  # fused_uvm_caching: rows updated in the cache, written back before any read
    tables = _TableStager(out, tracker, decision, budget if limited else None, column_counts, buffers)
    for table in tracker.tables():
        shape = tracker.table_shape(table)
        if shape is not None:
            out.table_shapes[table] = list(shape)
        if not tracker.is_data_parallel(table):
            tables.stage(table)
        elif rank == 0:
            (kernel, shard), *_ = tracker.shards(table)
            out.replicated_tables[table] = _host_copy(kernel.tbe.split_embedding_weights()[shard.local_index])
    _stage_rank_state(out, job)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the pinned copies above were asynchronous
    out.stall_ms = (time.perf_counter() - t0) * 1e3
    if budget is not None and limited:
        log.info("budget-limited delta %d (%s, max_rows_fraction %s): %d of %d dirty rows written, %d left dirty",
                 decision.ckpt_id, budget.priority, budget.max_rows_fraction, tables.dirty_total - tables.left_total,
                 tables.dirty_total, tables.left_total)
    return out


def _budget_applies(decision: Decision, budget: BudgetConfig | None) -> bool:
    """Whether ``budget`` limits this save's rows: a delta of a consecutive chain with a row fraction set."""
    limited = budget is not None and budget.max_rows_fraction is not None and decision.kind == "delta"
    if limited and decision.since == "baseline":
        raise ConfigError(
            "budget.max_rows_fraction needs policy consecutive: a one-shot delta is restored from the baseline "
            "and the latest delta alone, so rows a budget left out would lose their saved updates"
        )
    return limited


class _TableStager:
    """Stages the sharded tables of one save into ``out.shards``, shard by shard.

    ``budget`` is given only when it limits this save; its counts of dirty and left-out rows
    add up in ``dirty_total`` and ``left_total``.
    """

    def __init__(self, out: Staged, tracker: DirtyRowTracker, decision: Decision, budget: BudgetConfig | None,
                 column_counts: dict[str, Any], buffers: StagingBuffers | None) -> None:
        self.out, self.tracker, self.decision, self.budget = out, tracker, decision, budget
        self.column_counts, self.buffers = column_counts, buffers
        self.views: dict[int, tuple[list, list]] = {}
        self.dirty_total = self.left_total = 0

    def stage(self, table: str) -> None:
        """This rank's shards of ``table``: whole where the decision says ``full`` (and no budget applies),
        else their dirty rows (or those the budget keeps), with ids."""
        encoding = self.decision.encodings.get(table, "full")
        if encoding == "full" and self.budget is None:  # whole shards: no need for their dirty rows
            self.tracker.check_lookups(table)
            shard_dirty: list[tuple[Any, Any, torch.Tensor | None]] = [
                (kernel, shard, None) for kernel, shard in self.tracker.shards(table)]
        else:
            shard_dirty = list(self.tracker.shard_dirty_rows(table, since_baseline=self.decision.since == "baseline"))
        chosen = self._choose(table, shard_dirty) if self.budget is not None else {}
        for kernel, shard, dirty in shard_dirty:
            if shard.rows in chosen:  # the budget is smaller than the shard: selected rows, with ids
                self._shard(table, kernel, shard, "rows", chosen[shard.rows])
            else:
                self._shard(table, kernel, shard, encoding, dirty)

    def _choose(self, table: str, shard_dirty: list) -> dict[tuple[int, int], torch.Tensor]:
        """The rows the budget keeps per shard (those it leaves out stay dirty, in ``out.left_out``)."""
        assert self.budget is not None and self.budget.max_rows_fraction is not None  # called only under a budget
        chosen, left_out = choose_rows(self.tracker, table, shard_dirty, self.budget.max_rows_fraction,
                                       self.column_counts.get(table))
        if left_out.numel():
            self.out.left_out[table] = left_out
        self.dirty_total += sum(int(d.numel()) for d in {s.rows: d for _, s, d in shard_dirty}.values())
        self.left_total += int(left_out.numel())
        return chosen

    def _shard(self, table: str, kernel: Any, shard: Any, encoding: str, dirty: torch.Tensor | None) -> None:
        """One shard's weights and optimizer states: whole (``full``), or the ``dirty`` rows with their ids."""
        weights, all_states = _tbe_views(kernel.tbe, self.views)
        states = list(all_states[shard.local_index]) if all_states else []
        weights = weights[shard.local_index]
        ids = None if encoding == "full" else dirty
        rows = None if ids is None else ids.to(weights.device)
        key = (table, shard.rows, shard.cols)
        n = shard.num_rows if rows is None else int(rows.numel())

        def pick(t: torch.Tensor, what: Any) -> torch.Tensor:
            buf = None if self.buffers is None else self.buffers.take((*key, what), t, n, self.out.buffers)
            return _host_copy(t, buf) if rows is None else _gather_rows(t, rows, buf)

        staged_states = []
        for j, s in enumerate(states):
            rowwise = is_rowwise(s, shard.num_rows)
            s2 = s.reshape(shard.num_rows) if rowwise else s.reshape(shard.num_rows, -1)
            staged_states.append((pick(s2, j), rowwise))
        staged = StagedShard(table, shard.rows, shard.cols, encoding, ids, pick(weights, "w"), staged_states)
        mc = self.tracker.mc_table(table)
        if mc is not None:  # row-wise sharded: this rank's slots are the shard
            staged.mc, staged.mc_fields = mc.by_row(rows), mc.fields
        self.out.shards.append(staged)


def _stage_rank_state(out: Staged, job: JobState) -> None:
    """What is not a sharded table: the TBE step, the dense part and its optimizer (rank 0's: DDP
    keeps them alike), this rank's ``extra_state``, RNG and managed-collision eviction windows."""
    model, tracker, dense_optimizer = job.model, job.tracker, job.dense_optimizer
    iters = [int(it.item()) for tbe in tracker.tbes()
             if isinstance(it := getattr(tbe, "iter", None), torch.Tensor) and it.numel() == 1]
    out.tbe_iter = max(iters, default=0)
    if out.rank == 0:
        out.dense = {n: _host_copy(t) for n, t in dense_named_state(model, tracker.module_fqns()).items()}
        if dense_optimizer is not None:
            out.dense_optimizer = _clone_tree(state_to_save(model, dense_optimizer))
    out.extra = {name: _clone_tree(obj.state_dict()) for name, obj in job.extra_state.items()}
    out.rng = _clone_tree(rng_state())
    out.mc_runtime = {table: mc.runtime() for table, mc in tracker.mc_tables().items()}


