"""The shards this rank holds, as the checkpoint format records them (format/parts.py)."""

from __future__ import annotations

from cnr_torchrec.ckpt.format.placement import Box
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["shard_boxes"]


def shard_boxes(tracker: DirtyRowTracker) -> list[Box]:
    """The shards of the sharded tables this rank holds, ``[table, row_start, row_end, col_start, col_end]``,
    sorted. Data_parallel tables, which every rank holds and rank 0 stores for all, are left out."""
    return sorted([t, *s.rows, *s.cols] for t in tracker.tables() if not tracker.is_data_parallel(t)
                  for _, s in tracker.shards(t))
