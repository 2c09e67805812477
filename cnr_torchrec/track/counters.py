"""Per-row lookup counters, which rank dirty rows for CPR's budget-limited saves.

MFU counts every looked-up id; SSU counts a Bernoulli(rate) sample of them, drawn from
a generator of the tracker's own so that the training RNG stream is never touched.
The marking hook feeds the counters (see ``hooks.py``); this module owns them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from cnr_torchrec.errors import ConfigError, TrackingNotEnabledError
from cnr_torchrec.track.discovery import ShardSlice, TrackedKernel
from cnr_torchrec.track.layout import ShardLayout

__all__ = ["LookupCounters", "TbeCounts"]

log = logging.getLogger(__name__)

_COUNT_MODES = ("mfu", "ssu")
_OFF = "lookup counters are off: construct the tracker with count_updates=True or call enable_counting()"


class TbeCounts:
    """The int32 counters of one TBE, one per row of its flat row space, and how they are fed.

    ``counts`` is None while counting is off. ``sample_rate`` is None where every lookup
    is counted (MFU, and data_parallel TBEs); otherwise ``generator`` draws SSU's sample.
    """

    def __init__(self, num_rows: int, device: torch.device, on: bool) -> None:
        self.num_rows = num_rows
        self.device = device
        self.counts = torch.zeros(num_rows, dtype=torch.int32, device=device) if on else None
        self.sample_rate: float | None = None
        self.generator: torch.Generator | None = None

    def restart(self, kept: torch.Tensor | None) -> None:
        """Zeroes the counters, but those of the flat rows ``kept``, which a later save must still rank."""
        if self.counts is None:
            return
        saved = None if kept is None else self.counts.index_select(0, kept)
        self.counts.zero_()
        if kept is not None and saved is not None:
            self.counts.index_copy_(0, kept, saved)


class LookupCounters:
    """The counters of every TBE of this rank, read per table and shard."""

    def __init__(self, layout: ShardLayout, count_updates: bool) -> None:
        self._layout = layout
        self.tbes = [TbeCounts(info.num_rows, device, count_updates)
                     for info, device in zip(layout.kernels, layout.devices)]

    @property
    def mode(self) -> str | None:
        """``"mfu"``, ``"ssu"`` or None (off), as the first sharded TBE counts."""
        sharded = [c for info, c in zip(self._layout.kernels, self.tbes) if not info.data_parallel]
        if not sharded or sharded[0].counts is None:
            return None
        return "mfu" if sharded[0].sample_rate is None else "ssu"

    def enable(self, mode: str, rate: float, seed: int) -> None:
        """Starts counting in ``mode`` (see ``DirtyRowTracker.enable_counting``).

        Raises:
            ConfigError: unknown mode or a rate outside (0, 1].
        """
        if mode not in _COUNT_MODES:
            raise ConfigError(f"counting mode {mode!r} is not one of {list(_COUNT_MODES)}")
        if mode == "ssu" and not (isinstance(rate, (int, float)) and 0.0 < rate <= 1.0):
            raise ConfigError(f"ssu rate must be in (0, 1], got {rate!r}")
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        for i, (info, c) in enumerate(zip(self._layout.kernels, self.tbes)):
            if c.counts is None:  # data_parallel TBEs too, as with count_updates=True (they stay at zero)
                c.counts = torch.zeros(c.num_rows, dtype=torch.int32, device=c.device)
            if mode == "mfu" or info.data_parallel:
                c.sample_rate, c.generator = None, None
                continue
            c.sample_rate = float(rate)
            c.generator = torch.Generator(device=c.device)
            # Distinct, reproducible streams per (seed, rank, TBE).
            c.generator.manual_seed(((int(seed) * 1_000_003 + rank) * 1_009 + i) % 2**63)
        log.info("lookup counters on (%s%s)", mode, f", rate {rate}" if mode == "ssu" else "")

    def restart(self, kept: dict[int, torch.Tensor]) -> None:
        """Zeroes every counter but those of the flat rows ``kept`` holds per TBE index."""
        for i, c in enumerate(self.tbes):
            c.restart(kept.get(i))

    def bits(self) -> int:
        """Bits held for the sharded (not data_parallel) TBEs."""
        return sum(c.counts.numel() * 32 for info, c in zip(self._layout.kernels, self.tbes)
                   if not info.data_parallel and c.counts is not None)

    def update_counts(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(global row ids, int32 counts, on CPU) over every row this rank holds of ``table``."""
        rows, counts = [], []
        for i, s in self._layout.shards(table):
            c = self._live(i)
            rows.append(torch.arange(s.rows[0], s.rows[1], dtype=torch.int64))
            counts.append(c[s.flat_start : s.flat_start + s.num_rows].cpu())
        if not rows:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)
        return torch.cat(rows), torch.cat(counts)

    def shard_update_counts(self, table: str) -> list[tuple[TrackedKernel, ShardSlice, torch.Tensor]]:
        """Per sharded shard of ``table``: a view of its live counters, one per shard row."""
        out = []
        for i, s in self._layout.shards(table):
            info = self._layout.kernels[i]
            if info.data_parallel:
                continue
            out.append((info, s, self._live(i)[s.flat_start : s.flat_start + s.num_rows]))
        return out

    def _live(self, i: int) -> torch.Tensor:
        counts = self.tbes[i].counts
        if counts is None:
            raise TrackingNotEnabledError(_OFF)
        return counts
