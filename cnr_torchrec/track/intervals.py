"""The dirty-row bitmaps of the tracking intervals, and the views of them that a save reads.

A TBE's rows are one bit each in its flat row space. ``bitmap`` holds the rows looked
up since the last reset; ``baseline``, where it is kept, the rows of the earlier
intervals since the last ``reset(baseline=True)``. The "since baseline" view is
``baseline | bitmap``, so a reset costs one OR, never a second pass over the ids.
"""

from __future__ import annotations

import torch

from cnr_torchrec import ops
from cnr_torchrec.errors import TrackingNotEnabledError
from cnr_torchrec.track.discovery import ShardSlice, TrackedKernel
from cnr_torchrec.track.layout import ShardLayout

__all__ = ["DirtyIntervals", "TbeBits"]


class TbeBits:
    """The dirty bits of one TBE: this interval's, and optionally those since the baseline."""

    def __init__(self, num_rows: int, device: torch.device, baseline: bool) -> None:
        self.num_rows = num_rows
        self.bitmap = torch.zeros(ops.bitmap_words(num_rows), dtype=torch.int64, device=device)
        self.baseline = torch.zeros_like(self.bitmap) if baseline else None

    def view(self, since_baseline: bool) -> torch.Tensor:
        """The rows dirty since the last reset, or since the baseline (a new tensor then)."""
        if not since_baseline:
            return self.bitmap
        if self.baseline is None:
            raise TrackingNotEnabledError(
                "construct the tracker with baseline_view=True to query rows dirty since the baseline"
            )
        return self.baseline | self.bitmap

    def restart(self, *, baseline: bool, kept: torch.Tensor | None) -> None:
        """Starts a new interval with only the flat rows ``kept`` set (see ``DirtyRowTracker.reset``)."""
        if self.baseline is not None:
            if baseline:
                self.baseline.zero_()
            else:
                # Kept rows are folded in too: the view is ``baseline | bitmap``, so either way they are in it.
                self.baseline.bitwise_or_(self.bitmap)
        self.bitmap.zero_()
        if kept is not None:
            self.mark(kept)

    def mark(self, flat_rows: torch.Tensor) -> None:
        """Marks flat rows dirty in this interval (one feature over the TBE's whole flat row space)."""
        offsets = torch.tensor([0, flat_rows.numel()], dtype=torch.int64, device=self.bitmap.device)
        space = torch.tensor([0, self.num_rows], dtype=torch.int64, device=self.bitmap.device)
        ops.mark_rows(flat_rows, offsets, space, space[1:], self.bitmap)

    def bits(self) -> int:
        """Bits held for this TBE, both views."""
        return self.bitmap.numel() * 64 + (0 if self.baseline is None else self.baseline.numel() * 64)


class DirtyIntervals:
    """The bitmaps of every TBE of this rank, read per table and shard.

    Queries here read the bitmaps as they are: the tracker raises the problems that
    sync-free tracking recorded before it asks (see ``DirtyRowTracker.check_lookups``).
    data_parallel shards report every row as dirty: a dense optimizer may change any row.
    """

    def __init__(self, layout: ShardLayout, baseline_view: bool) -> None:
        self._layout = layout
        self.tbes = [TbeBits(info.num_rows, device, baseline_view)
                     for info, device in zip(layout.kernels, layout.devices)]

    @property
    def has_baseline_view(self) -> bool:
        return all(b.baseline is not None for b in self.tbes)

    def enable_baseline_view(self) -> None:
        """Starts an empty "since baseline" view on every TBE that has none."""
        for b in self.tbes:
            if b.baseline is None:
                b.baseline = torch.zeros_like(b.bitmap)

    def restart(self, *, baseline: bool, kept: dict[int, torch.Tensor]) -> None:
        """Starts a new interval on every TBE, keeping the flat rows ``kept`` holds for it."""
        for i, b in enumerate(self.tbes):
            b.restart(baseline=baseline, kept=kept.get(i))

    def mark(self, flat: dict[int, torch.Tensor]) -> None:
        """Marks flat rows dirty in this interval, per TBE index."""
        for i, rows in flat.items():
            self.tbes[i].mark(rows)

    def bits(self) -> int:
        """Bits held for the sharded (not data_parallel) TBEs."""
        return sum(b.bits() for info, b in zip(self._layout.kernels, self.tbes) if not info.data_parallel)

    def shard_rows(self, i: int, s: ShardSlice, since_baseline: bool) -> torch.Tensor:
        """Global ids of the dirty rows of shard ``s`` of TBE ``i`` (int64, CPU, sorted)."""
        if self._layout.kernels[i].data_parallel:
            return torch.arange(s.rows[0], s.rows[1], dtype=torch.int64)
        bits = self.tbes[i].view(since_baseline)
        local = ops.bitmap_to_rows(bits, s.flat_start, s.flat_start + s.num_rows).cpu()
        return local + (s.rows[0] - s.flat_start)

    def shard_dirty_rows(
        self, table: str, since_baseline: bool
    ) -> list[tuple[TrackedKernel, ShardSlice, torch.Tensor]]:
        """Per shard of ``table``: the dirty rows as offsets into the shard."""
        return [(self._layout.kernels[i], s, self.shard_rows(i, s, since_baseline) - s.rows[0])
                for i, s in self._layout.shards(table)]

    def dirty_rows(self, table: str, since_baseline: bool) -> torch.Tensor:
        """Sorted, unique global ids of the dirty rows of ``table`` (the union of its column shards)."""
        parts = [self.shard_rows(i, s, since_baseline) for i, s in self._layout.shards(table)]
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        if len(parts) == 1:
            return parts[0]
        return torch.unique(torch.cat(parts), sorted=True)

    def dirty_count(self, table: str, since_baseline: bool) -> int:
        """How many rows of ``table`` are dirty, counted on the device where one shard holds them."""
        shards = self._layout.shards(table)
        if not shards:
            return 0
        if len(shards) > 1:  # column shards of one table: count the union once
            return int(self.dirty_rows(table, since_baseline).numel())
        i, s = shards[0]
        if self._layout.kernels[i].data_parallel:
            return s.num_rows
        bounds = torch.tensor([s.flat_start, s.flat_start + s.num_rows], dtype=torch.int64)
        return int(ops.bitmap_count(self.tbes[i].view(since_baseline), bounds)[0])
