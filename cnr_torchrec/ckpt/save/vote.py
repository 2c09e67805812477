"""The save's vote: what each rank brings to the decision of a save, gathered in one all-gather.

Every rank calls :meth:`SaveVote.gather` at the same save with its own vote; each gets back the
same reduced vote, on which the planner decides: row counts summed over the ranks, the step and
stall times of the slowest rank, the compaction in flight over (and heard to commit) only if it is
on every rank, and the save skipped if any rank is still writing the previous one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["SaveVote"]


@dataclasses.dataclass(frozen=True)
class SaveVote:
    """One rank's vote, or (from :meth:`gather`) every rank's together.

    Attributes:
        dirty_since_previous: rows dirty since the previous save, by table.
        dirty_since_baseline: rows dirty since the chain's baseline (or a compaction's tip), by table.
        held_rows: rows of the table's shards, by table.
        step_s: the seconds a training step takes.
        stall_s: the seconds the last save stalled training.
        compaction_finished: this rank's part of the compaction in flight is over.
        compaction_committed: ... and it heard the compaction commit.
        busy: the previous save is still writing.
    """

    dirty_since_previous: Mapping[str, int]
    dirty_since_baseline: Mapping[str, int]
    held_rows: Mapping[str, int]
    step_s: float
    stall_s: float
    compaction_finished: bool
    compaction_committed: bool
    busy: bool

    def gather(self, tables: Sequence[str], all_gather: Callable[[torch.Tensor], torch.Tensor]) -> SaveVote:
        """Every rank's votes reduced, from one all-gather of an int64 row per rank (``all_gather`` stacks every
        rank's row in rank order). ``tables``: the tables, in the same order on every rank."""
        n = len(tables)
        counts = [getattr(self, f.name)[t] for f in _COUNTS for t in tables]
        times = [round(self.step_s * 1e6), round(self.stall_s * 1e6)]  # microseconds
        flags = [int(self.compaction_finished), int(self.compaction_committed), int(self.busy)]
        local = torch.tensor(counts + times + flags, dtype=torch.int64)
        rows = all_gather(local)
        total, slowest = rows.sum(0).tolist(), rows.max(0).values.tolist()
        ranks = rows.shape[0]
        finished, committed, busy = total[3 * n + 2 :]
        return SaveVote(
            **{f.name: dict(zip(tables, total[i * n : (i + 1) * n])) for i, f in enumerate(_COUNTS)},
            step_s=slowest[3 * n] / 1e6, stall_s=slowest[3 * n + 1] / 1e6,
            compaction_finished=finished == ranks, compaction_committed=committed == ranks, busy=busy > 0,
        )


_COUNTS = dataclasses.fields(SaveVote)[:3]  # the per-table counts, in the order the all-gather carries them
