"""Dirty-row tracking at one bit per row, inside the FBGEMM TBE lookups of a DMP.

``DirtyRowTracker`` is the public face; its parts each own their state:

* ``layout.py``: the plan's tables and this rank's shards of them on each TBE;
* ``hooks.py``: the forward hooks that mark each training lookup's rows, check its
  bounds and hold it in flight until its update has run;
* ``intervals.py``: the dirty-row bitmaps of each interval and the views a save reads;
* ``counters.py``: the per-row lookup counters (MFU/SSU) of budget-limited saves;
* ``managed_collision.py``: the remapping state of managed-collision (sort-zch) tables, and
  the rows their evictions change without a lookup.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cnr_torchrec.track.counters import LookupCounters
from cnr_torchrec.track.discovery import ShardSlice, TorchRecModule, TrackedKernel, find_kernels, plan_table_shapes
from cnr_torchrec.track.hooks import LookupHooks, _KernelState
from cnr_torchrec.track.intervals import DirtyIntervals
from cnr_torchrec.track.layout import ShardLayout
from cnr_torchrec.track.managed_collision import McTable, find_mc_tables

__all__ = ["DirtyRowTracker"]


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

    Managed-collision (sort-zch) tables are tracked like any other, plus the rows their
    evictions change without a lookup: the rows whose remapping state (raw id, counts, last
    access) an eviction changed, and the rows it re-initialised (see ``managed_collision.py``).

    Raises:
        UnsupportedShardingError: a table is not on an FBGEMM TBE with a fused optimizer,
            or is remapped by a managed-collision module other than sort-zch.
    """

    def __init__(
        self,
        dmp: TorchRecModule,
        *,
        count_updates: bool = False,
        baseline_view: bool = False,
        fuse_bounds_check: bool = True,
        sync_free: bool | None = None,
    ) -> None:
        self._layout = ShardLayout(plan_table_shapes(dmp), find_kernels(dmp))
        self._intervals = DirtyIntervals(self._layout, baseline_view)
        self._counters = LookupCounters(self._layout, count_updates)
        self._hooks = LookupHooks(self._layout, self._intervals.tbes, self._counters.tbes,
                                  fuse_bounds_check=fuse_bounds_check, sync_free=sync_free)
        self._mc, self._mc_undo = find_mc_tables(dmp, self.mark_changed)

    @property
    def _kernels(self) -> list[_KernelState]:
        # Each TBE's state as the hooks keep it (its info, lookups in flight, bitmap in .bits): tests
        # and benchmarks inspect it.
        return self._hooks.states

    @property
    def sync_free(self) -> bool:
        """Whether any TBE of this rank is tracked sync-free (its lookup problems raised by queries)."""
        return self._hooks.sync_free

    @property
    def fused_bounds_check(self) -> bool:
        """Whether the marking pass stands in for FBGEMM's bounds check on any TBE of this rank."""
        return self._hooks.fused_bounds_check

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
        self._hooks.check(None if table is None else self._layout.kernels_of(table))

    # ------------------------------------------------------------------ queries

    def tables(self) -> list[str]:
        """Names of every embedding table of the model, as in its table configs."""
        return self._layout.tables()

    def tbes(self) -> list[TorchRecModule]:
        """Every TBE this rank runs (sharded and data_parallel)."""
        return [info.tbe for info in self._layout.kernels]

    def module_fqns(self) -> list[str]:
        """Fully qualified names of the sharded embedding modules, as in the plan."""
        return sorted({str(self._layout.entry(t)["module"]) for t in self._layout.tables()})

    def sharding_type(self, table: str) -> str:
        """The sharding type of ``table`` in the plan (``"row_wise"``, ``"data_parallel"``, ...)."""
        return str(self._layout.entry(table)["sharding_type"])

    def is_data_parallel(self, table: str) -> bool:
        """Whether ``table`` is replicated (data_parallel) rather than sharded."""
        return self.sharding_type(table) == "data_parallel"

    def shard_ranges(self, table: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """This rank's ``((row_start, row_end), (col_start, col_end))`` for each shard of ``table``."""
        return [(s.rows, s.cols) for _, s in self._layout.shards(table)]

    def shards(self, table: str) -> list[tuple[TrackedKernel, ShardSlice]]:
        """This rank's shards of ``table``, with the TBE that holds each."""
        return [(self._layout.kernels[i], s) for i, s in self._layout.shards(table)]

    def table_module(self, table: str) -> str:
        """The name of the sharded module that holds ``table`` in the model (``"sparse.ebc"``).

        Raises:
            UnknownTableError: the model has no table of that name.
        """
        return str(self._layout.entry(table)["module"])

    def table_shape(self, table: str) -> tuple[int, int] | None:
        """``(num_embeddings, embedding_dim)`` of the whole table, or None if this rank holds none of it."""
        return self._layout.table_shape(table)

    def shard_dirty_rows(
        self, table: str, *, since_baseline: bool = False
    ) -> list[tuple[TrackedKernel, ShardSlice, torch.Tensor]]:
        """Per shard of ``table`` on this rank: the dirty rows as offsets into the shard (int64, CPU)."""
        self._layout.entry(table)
        self.check_lookups(table)
        return self._intervals.shard_dirty_rows(table, since_baseline)

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
        self._layout.entry(table)
        self.check_lookups(table)
        return self._intervals.dirty_rows(table, since_baseline)

    def dirty_counts(self, *, since_baseline: bool = False) -> dict[str, int]:
        """Number of dirty rows of each table on this rank (column shards of a table counted once)."""
        self.check_lookups()
        return {t: self._intervals.dirty_count(t, since_baseline) for t in self._layout.tables()}

    def update_counts(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row lookup counters of this rank's rows of ``table`` (needs ``count_updates=True``).

        Returns:
            (global row ids, int32 counts) over every row this rank holds of ``table``.
        """
        return self._counters.update_counts(table)

    def shard_update_counts(self, table: str) -> list[tuple[TrackedKernel, ShardSlice, torch.Tensor]]:
        """Per shard of ``table`` on this rank: its int32 counters, one per shard row, where they live.

        The tensors are views of the live counters (no copy); index them with the offsets
        :meth:`shard_dirty_rows` returns. data_parallel shards have no counters and are left out.

        Raises:
            TrackingNotEnabledError: counters are off (see :meth:`enable_counting`).
        """
        return self._counters.shard_update_counts(table)

    @property
    def counting(self) -> str | None:
        """``"mfu"`` (every lookup counted), ``"ssu"`` (a sample counted) or None (no counters)."""
        return self._counters.mode

    @property
    def bits_per_row(self) -> float:
        """Tracking state held per embedding row on this rank, in bits."""
        rows = sum(info.num_rows for info in self._layout.kernels if not info.data_parallel)
        if rows == 0:
            return 0.0
        return (self._intervals.bits() + self._counters.bits()) / rows

    def mc_table(self, table: str) -> McTable | None:
        """This rank's managed-collision module of ``table``, or None where a plain EBC/EC holds it."""
        self._layout.entry(table)
        return self._mc.get(table)

    def mc_tables(self) -> dict[str, McTable]:
        """This rank's managed-collision tables, by name."""
        return dict(self._mc)

    # ------------------------------------------------------------------ updates

    def mark_changed(self, table: str, rows: torch.Tensor) -> None:
        """Marks global rows of ``table`` dirty in this interval: rows that changed without a lookup (an
        eviction's). Rows this rank does not hold are ignored."""
        self._intervals.mark(self._layout.kept_flat_rows({table: rows}))

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
        kept = self._layout.kept_flat_rows(keep or {})
        self._counters.restart(kept)
        self._intervals.restart(baseline=baseline, kept=kept)
        self._hooks.remark_in_flight()

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
        self._counters.enable(mode, rate, seed)

    def enable_baseline_view(self) -> None:
        """Starts keeping the "since baseline" view, if it is not kept already.

        A new view starts empty: rows looked up before this call are not in it, so
        take a baseline (``reset(baseline=True)``) before relying on it.
        """
        self._intervals.enable_baseline_view()

    @property
    def has_baseline_view(self) -> bool:
        return self._intervals.has_baseline_view

    def remove(self) -> None:
        """Detaches the hooks, and gives the TBEs back their configured bounds checks."""
        self._hooks.remove()
        for undo in self._mc_undo:
            undo()
        self._mc_undo = []
