"""Dirty-row tracking at one bit per row, inside the FBGEMM TBE lookups of a DMP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cnr_torchrec import ops
from cnr_torchrec.errors import RowIdOutOfRangeError, TrackingNotEnabledError, UnknownTableError
from cnr_torchrec.track._discovery import ShardSlice, TrackedKernel, find_kernels, plan_table_shapes

__all__ = ["DirtyRowTracker"]


class _KernelState:
    """Bitmaps (and optional counters) of one TBE, in its flat row space."""

    def __init__(self, info: TrackedKernel, device: torch.device, count_updates: bool) -> None:
        self.info = info
        words = ops.bitmap_words(info.num_rows)
        self.bitmap = torch.zeros(words, dtype=torch.int64, device=device)
        self.baseline: torch.Tensor | None = None
        self.counts = torch.zeros(info.num_rows, dtype=torch.int32, device=device) if count_updates else None
        # Names of the tables behind each feature, for error messages only.
        ftm = getattr(info.tbe, "feature_table_map", None) or list(range(len(info.shards)))
        self.feature_tables = [info.shards[t].table for t in ftm]


class DirtyRowTracker:
    """Records which embedding rows each training step looks up, per shard, at 1 bit per row.

    A forward pre-hook on every TBE (``kernel.emb_module``) passes the lookup's
    ``indices``/``offsets`` to ``torch.ops.cnr.mark_rows``. Under the fused
    optimizers FBGEMM supports, the rows a step changes are a subset of the rows it
    looks up, so the bitmap is exactly what a differential checkpoint must save.

    Two views are kept:

    * "since reset": rows looked up since the last :meth:`reset` (consecutive deltas);
    * "since baseline": rows looked up since the last ``reset(baseline=True)``
      (one-shot deltas), kept only with ``baseline_view=True``. Each :meth:`reset`
      ORs the first view into a second bitmap, so it costs one more bit per row
      and never a second pass over the ids.

    data_parallel tables report every row as dirty: a dense optimizer may change any row.

    Args:
        dmp: the sharded model (a DistributedModelParallel).
        count_updates: also keep an int32 lookup counter per row (32 more bits per row).
        baseline_view: allocate the "since baseline" view from the start.

    Raises:
        UnsupportedShardingError: a table is not on an FBGEMM TBE with a fused optimizer.
    """

    def __init__(self, dmp: nn.Module, *, count_updates: bool = False, baseline_view: bool = False) -> None:
        self._plan_tables = plan_table_shapes(dmp)
        self._kernels: list[_KernelState] = []
        self._shards: dict[str, list[tuple[_KernelState, ShardSlice]]] = {t: [] for t in self._plan_tables}
        self._num_embeddings: dict[str, int] = {}
        self._dims: dict[str, int] = {}
        self._handles = []
        for info in find_kernels(dmp):
            # Bitmaps live where the TBE keeps its row offsets, so the hook never copies.
            state = _KernelState(info, info.tbe.hash_size_cumsum.device, count_updates)
            if baseline_view:
                state.baseline = torch.zeros_like(state.bitmap)
            self._kernels.append(state)
            for cfg, shard in zip(info.kernel.config.embedding_tables, info.shards):
                self._shards[shard.table].append((state, shard))
                self._num_embeddings[shard.table] = int(cfg.num_embeddings)
                self._dims[shard.table] = int(cfg.embedding_dim)
            if not info.data_parallel:
                self._handles.append(info.tbe.register_forward_pre_hook(self._make_hook(state), with_kwargs=True))

    # ------------------------------------------------------------------ hook

    def _make_hook(self, state: _KernelState):
        bitmap, counts = state.bitmap, state.counts
        hsc = state.info.tbe.hash_size_cumsum

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not (module.training and torch.is_grad_enabled()):
                return
            indices = kwargs["indices"] if "indices" in kwargs else args[0]
            offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
            vbe = kwargs.get("batch_size_per_feature_per_rank")
            b_offsets = None
            if vbe is not None:
                per_feature = [sum(b) for b in vbe]
                b_offsets = torch.tensor([0] + per_feature, dtype=torch.int64).cumsum(0).to(bitmap.device)
            try:
                ops.mark_rows(indices, offsets, hsc, bitmap, counts, b_offsets)
            except IndexError as e:
                raise self._out_of_range(state, indices, offsets, b_offsets) from e

        return hook

    def _out_of_range(self, state, indices, offsets, b_offsets) -> RowIdOutOfRangeError:
        # Error path only: locate the offending feature with the pure-torch reference logic.
        hsc = state.info.tbe.hash_size_cumsum.cpu().long()
        T = hsc.numel() - 1
        offsets = offsets.cpu().long()
        if b_offsets is None:
            b_offsets = torch.arange(T + 1) * ((offsets.numel() - 1) // T)
        starts = offsets[b_offsets.cpu()]
        for f in range(T):
            ids = indices[int(starts[f]) : int(starts[f + 1])].cpu().long()
            size = int(hsc[f + 1] - hsc[f])
            bad = ids[(ids < 0) | (ids >= size)]
            if bad.numel():
                return RowIdOutOfRangeError(
                    f"table '{state.feature_tables[f]}' was looked up with id {int(bad[0])}, outside the "
                    f"{size} rows this shard holds ({bad.numel()} bad ids in the batch); check that the input "
                    "ids are below the table's num_embeddings"
                )
        return RowIdOutOfRangeError("a looked-up id is outside its table; check the input ids")

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
        """
        self._entry(table)
        parts = [self._shard_rows(state, s, since_baseline) for state, s in self._shards[table]]
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        if len(parts) == 1:
            return parts[0]
        return torch.unique(torch.cat(parts), sorted=True)

    def dirty_counts(self, *, since_baseline: bool = False) -> dict[str, int]:
        """Number of dirty rows of each table on this rank (column shards of a table counted once)."""
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
                raise TrackingNotEnabledError("construct the tracker with count_updates=True to read lookup counts")
            rows.append(torch.arange(s.rows[0], s.rows[1], dtype=torch.int64))
            counts.append(state.counts[s.flat_start : s.flat_start + s.num_rows].cpu())
        if not rows:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)
        return torch.cat(rows), torch.cat(counts)

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

    def reset(self, *, baseline: bool = False) -> None:
        """Starts a new tracking interval.

        Args:
            baseline: also restart the "since baseline" view (a full checkpoint was
                just taken). Otherwise the interval's rows are folded into that view.
        """
        for k in self._kernels:
            if k.baseline is not None:
                if baseline:
                    k.baseline.zero_()
                else:
                    k.baseline.bitwise_or_(k.bitmap)
            k.bitmap.zero_()
            if k.counts is not None:
                k.counts.zero_()

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
        """Detaches the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ internals

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
