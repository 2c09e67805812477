"""CPR's priority order for budget-limited saves: which dirty rows a save writes first.

A budget-limited save writes at most ``ceil(max_rows_fraction * rows)`` rows of each shard.
The rows it writes are the dirty ones looked up most often since they were last written
(MFU: exact per-row counters; SSU: counters fed by a sample of the lookups), so the rows
whose staleness costs most after a restore are the freshest. The rows left out stay dirty
and keep their counts, so they climb the order until a later save writes them.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.distributed as dist

from cnr_torchrec.errors import ConfigError
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.track.discovery import ShardSlice, TrackedKernel

__all__ = ["choose_rows", "gather_column_counts", "row_budget", "select_rows"]


def row_budget(max_rows_fraction: float, num_rows: int) -> int:
    """Rows a shard of ``num_rows`` rows may write per save: ``ceil(max_rows_fraction * num_rows)``.

    Raises:
        ConfigError: ``max_rows_fraction`` outside (0, 1].
    """
    if not 0.0 < max_rows_fraction <= 1.0:
        raise ConfigError(f"budget.max_rows_fraction must be in (0, 1], got {max_rows_fraction}")
    # The fraction as written (its shortest repr), so that 0.3 of 10 rows is 3, not
    # ceil(3.0000000000000004) = 4 as float arithmetic would have it.
    return min(num_rows, math.ceil(Fraction(repr(float(max_rows_fraction))) * num_rows))


def select_rows(dirty_offsets: torch.Tensor, counts: torch.Tensor, budget_rows: int) -> torch.Tensor:
    """The ``budget_rows`` dirty rows with the highest counts, ties broken by lower row id.

    Args:
        dirty_offsets: int64 row offsets (into a shard) of the dirty rows, unique.
        counts: one count per entry of ``dirty_offsets`` (any integer dtype), on the same device.
        budget_rows: how many rows may be written; more than there are dirty rows selects them all.

    Returns:
        The chosen offsets, sorted ascending (what restore and the id encoding expect),
        on the device of ``dirty_offsets``.

    Raises:
        ConfigError: ``budget_rows`` is negative, or ``counts`` does not match ``dirty_offsets``.
    """
    if budget_rows < 0:
        raise ConfigError(f"a save's row budget must be >= 0, got {budget_rows}")
    if counts.shape != dirty_offsets.shape or dirty_offsets.dim() != 1:
        raise ConfigError(
            f"select_rows needs one count per dirty row: got {tuple(counts.shape)} counts for "
            f"{tuple(dirty_offsets.shape)} rows"
        )
    ids = dirty_offsets.long()
    if budget_rows >= ids.numel():
        return torch.sort(ids).values
    # Order by id first, then a stable sort by descending count keeps the lower id first among ties.
    by_id = torch.sort(ids)
    ordered_counts = counts.long().index_select(0, by_id.indices)
    by_count = torch.sort(ordered_counts, descending=True, stable=True)
    chosen = by_id.values.index_select(0, by_count.indices[:budget_rows])
    return torch.sort(chosen).values


# Sharding types whose shards of one row range are split by columns, possibly across ranks:
# every column shard of a row range must write the same rows.
_COLUMN_SPLIT = frozenset({"column_wise", "table_column_wise", "grid_shard"})


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_column_counts(tracker: DirtyRowTracker, priority: str, world_size: int) -> dict[str, torch.Tensor]:
    """SSU counters of column-split tables, summed over every column shard on every rank.

    Each column shard of a row range sees the same lookups, so MFU counters agree across
    them and need no exchange. SSU samples each shard's lookups independently, so column
    shards on different ranks would rank rows differently and write different rows; their
    counters are summed instead (a larger sample), with one all-reduce of 8 bytes per row
    of these tables. Collective: every rank calls it with the same arguments.

    Returns:
        ``{table: int64 counts per global row}`` for the column-split tables, on the
        collective device; empty when no exchange is needed.
    """
    if priority != "ssu" or world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return {}
    tables = [t for t in tracker.tables() if tracker.sharding_type(t) in _COLUMN_SPLIT]
    if not tables:
        return {}
    dev = _collective_device()
    # A rank may hold none of a table, so the sizes are agreed first.
    sizes = torch.tensor([(tracker.table_shape(t) or (0, 0))[0] for t in tables], dtype=torch.int64, device=dev)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    sizes_l = sizes.cpu().tolist()
    flat = torch.zeros(sum(sizes_l), dtype=torch.int64, device=dev)
    base = 0
    for t, n in zip(tables, sizes_l):
        for _, s, counts in tracker.shard_update_counts(t):
            flat[base + s.rows[0] : base + s.rows[1]] += counts.to(dev, torch.int64)
        base += n
    dist.all_reduce(flat)
    return dict(zip(tables, torch.split(flat, sizes_l)))


def choose_rows(
    tracker: DirtyRowTracker,
    table: str,
    shard_dirty: list[tuple[TrackedKernel, ShardSlice, torch.Tensor]],
    max_rows_fraction: float,
    column_counts: torch.Tensor | None = None,
) -> tuple[dict[tuple[int, int], torch.Tensor], torch.Tensor]:
    """The rows a budget-limited delta writes of each of this rank's row ranges of ``table``.

    The choice is made once per row range, so every column shard of it writes the same
    rows: from ``column_counts`` (see :func:`gather_column_counts`) when given, else from
    the sum of the local column shards' counters (identical under MFU).

    Args:
        tracker: the tracker, with counters on.
        table: a sharded (not data_parallel) table.
        shard_dirty: ``tracker.shard_dirty_rows(table)``.
        max_rows_fraction: share of a shard's rows a save may write.
        column_counts: counts per global row of ``table`` summed over all its column shards.

    Returns:
        ``({row range: chosen offsets}, left-out global rows)``, both int64 on CPU. A row
        range is absent when its budget covers the whole shard (nothing to limit).
    """
    by_range: dict[tuple[int, int], list[torch.Tensor]] = {}
    dirty_of: dict[tuple[int, int], torch.Tensor] = {}
    counters = {id(s): c for _, s, c in tracker.shard_update_counts(table)}
    for _, s, dirty in shard_dirty:
        dirty_of.setdefault(s.rows, dirty)
        by_range.setdefault(s.rows, [])
        if column_counts is None:
            c = counters[id(s)]
            by_range[s.rows].append(c.index_select(0, dirty.to(c.device)).to("cpu", torch.int64))
    chosen: dict[tuple[int, int], torch.Tensor] = {}
    left: list[torch.Tensor] = []
    for rows, dirty in dirty_of.items():
        budget = row_budget(max_rows_fraction, rows[1] - rows[0])
        if budget >= rows[1] - rows[0]:
            continue
        if column_counts is not None:
            counts = column_counts.index_select(0, (dirty + rows[0]).to(column_counts.device)).cpu()
        else:
            counts = torch.stack(by_range[rows]).sum(0)
        pick = select_rows(dirty, counts, budget)
        chosen[rows] = pick
        if pick.numel() < dirty.numel():
            left.append(dirty[~torch.isin(dirty, pick)] + rows[0])
    left_out = torch.cat(left) if left else torch.empty(0, dtype=torch.int64)
    return chosen, left_out
