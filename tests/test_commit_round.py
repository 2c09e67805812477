"""The commit round (cnr_torchrec/ckpt/commit_round.py) over a real c10d store (torch's HashStore), its ranks as
threads: every rank hears rank 0's outcome, a silent rank or a silent rank 0 is named, and a finished round leaves
nothing in the store."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from cnr_torchrec.ckpt.commit_round import CommitRound, Outcome, Report


def _run_ranks(store, world, own, commit, timeout_s=5.0, silent=()):
    """Runs the round on ``world`` threads (ranks in ``silent`` never join); returns each joining rank's outcome."""
    out: dict[int, Outcome] = {}

    def rank(r):
        out[r] = CommitRound(store, "7", r, world, timeout_s).run(own(r), commit)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world) if r not in silent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def _keys_left(store, world):
    names = ["7/result", "7/heard"] + [f"7/report/{r}" for r in range(world)]
    return [k for k in names if store.check([k])]


def test_every_rank_hears_what_rank_0_decided_from_every_report_and_the_store_is_cleared():
    store, seen = dist.HashStore(), []

    def commit(reports):
        seen.extend(reports)
        return Outcome(True, facts={"nbytes": sum(r.part["nbytes"] for r in reports)})

    out = _run_ranks(store, 4, lambda r: Report.of_part({"rank": r, "ok": True, "nbytes": 10 * (r + 1)}), commit)
    assert [r.rank for r in seen] == [0, 1, 2, 3]  # rank 0's own first, then by rank
    assert all(o.ok and o.heard and o.facts == {"nbytes": 100} for o in out.values()), out
    assert _keys_left(store, 4) == []


def test_a_failed_part_fails_the_commit_on_every_rank_naming_the_rank():
    store = dist.HashStore()

    def commit(reports):
        bad = [f"rank {r.rank}: {r.error}" for r in reports if not r.ok]
        return Outcome(not bad, "; ".join(bad))

    own = lambda r: Report.failed(r, "ENOSPC") if r == 2 else Report.of_part({"rank": r, "ok": True})  # noqa: E731
    out = _run_ranks(store, 3, own, commit)
    assert all(not o.ok and o.error == "rank 2: ENOSPC" and o.heard for o in out.values()), out
    assert _keys_left(store, 3) == []


def test_a_commit_that_raises_is_an_outcome_every_rank_hears():
    def commit(reports):
        raise OSError(28, "No space left on device")

    out = _run_ranks(dist.HashStore(), 2, lambda r: Report.of_part({"rank": r, "ok": True}), commit)
    assert all(not o.ok and "rank 0 could not commit: OSError" in o.error for o in out.values()), out


def test_a_rank_that_never_reports_is_named_by_rank_0():
    decided = []

    def commit(reports):
        decided.extend(reports)
        return Outcome(all(r.ok for r in reports), "; ".join(r.error for r in reports if not r.ok))

    out = _run_ranks(dist.HashStore(), 3, lambda r: Report.of_part({"rank": r, "ok": True}), commit,
                     timeout_s=0.3, silent={2})
    assert [(r.rank, r.ok) for r in decided] == [(0, True), (1, True), (2, False)]
    assert "no report within" in decided[2].error
    assert not out[0].ok and not out[1].ok and out[1].heard


def test_a_rank_that_hears_nothing_from_rank_0_says_so():
    out = _run_ranks(dist.HashStore(), 2, lambda r: Report.of_part({"rank": r, "ok": True}),
                     lambda reports: Outcome(True), timeout_s=0.3, silent={0})
    assert not out[1].ok and not out[1].heard and "no word from rank 0" in out[1].error


@pytest.mark.parametrize("report", [Report.failed(3, "boom"), Report.of_part({"rank": 1, "ok": True, "n": [1, 2]})])
def test_records_cross_the_store_unchanged(report):
    assert Report.from_json(report.to_json()) == report
    out = Outcome(True, "", facts={"nbytes": 3})
    assert Outcome.from_json(out.to_json()) == out
