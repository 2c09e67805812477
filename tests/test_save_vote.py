"""The save's vote (cnr_torchrec.ckpt.save.vote): what two ranks bring, reduced to what both decide on."""

from __future__ import annotations

import torch

from cnr_torchrec.ckpt.save.vote import SaveVote

TABLES = ["t0", "t1"]


def _vote(rank, **kw):
    fields = dict(dirty_since_previous={"t0": 3 + rank, "t1": 0}, dirty_since_baseline={"t0": 10, "t1": 7 * rank},
                  held_rows={"t0": 50, "t1": 25}, step_s=0.25 + rank, stall_s=0.5 - 0.25 * rank,
                  compaction_finished=True, compaction_committed=True, busy=False)
    return SaveVote(**{**fields, **kw})


def _gather(votes):
    """Each rank's reduced vote, the all-gather played by stacking the rows every rank would send."""
    rows = []

    def capture(local):
        rows.append(local)
        return local.unsqueeze(0)

    for v in votes:
        v.gather(TABLES, capture)
    stacked = torch.stack(rows)
    return [v.gather(TABLES, lambda _: stacked) for v in votes]


def test_counts_add_up_and_times_are_the_slowest_ranks():
    a, b = _gather([_vote(0), _vote(1)])
    assert a == b
    assert a.dirty_since_previous == {"t0": 7, "t1": 0}
    assert a.dirty_since_baseline == {"t0": 20, "t1": 7}
    assert a.held_rows == {"t0": 100, "t1": 50}
    assert (a.step_s, a.stall_s) == (1.25, 0.5)
    assert a.compaction_finished and a.compaction_committed and not a.busy


def test_a_compaction_is_over_only_where_every_rank_says_so_and_one_busy_rank_skips_the_save():
    (v, _) = _gather([_vote(0), _vote(1, compaction_committed=False)])
    assert v.compaction_finished and not v.compaction_committed
    (v, _) = _gather([_vote(0, compaction_finished=False, compaction_committed=False), _vote(1)])
    assert not v.compaction_finished and not v.compaction_committed
    (v, _) = _gather([_vote(0), _vote(1, busy=True)])
    assert v.busy


def test_one_process_gets_its_own_vote_back():
    v = _vote(0)
    assert v.gather(TABLES, lambda local: local.unsqueeze(0)) == v
