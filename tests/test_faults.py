"""Crashes: fault points, SIGKILLed ranks at every stage of a save, and a full disk.

The kill trials use the harness of benchmarks/reliability.py (``make reliability`` runs
100 of them): 2 gloo ranks forked from a preloaded forkserver train a tiny model with a
save after every step, one rank is SIGKILLed at a named point of the commit protocol or
by a timer, the survivor is reaped like torchrun does, and 2 fresh ranks restore from the
same root. Each restore is checked against the newest checkpoint that has a manifest on
disk (scanned by the harness, not by the code under test) and against the full state the
ranks wrote for that checkpoint id at stage time.
"""

from __future__ import annotations

import os
import sys

import pytest

from cnr_torchrec.ckpt import fault_injection as faults
from cnr_torchrec.errors import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import reliability  # noqa: E402

# ---- fault points ------------------------------------------------------------------


def test_fault_specs_parse():
    assert faults.parse("commit.before_manifest:rank=0:nth=2") == [faults.FaultSpec("commit.before_manifest", 0, 2)]
    assert faults.parse(" write.mid , gc.mid:nth=3") == [faults.FaultSpec("write.mid"),
                                                         faults.FaultSpec("gc.mid", None, 3)]
    assert faults.parse("") == [] and faults.parse(None) == []
    assert faults.parse("image.mid:rank=1:pause=1500") == [faults.FaultSpec("image.mid", 1, pause_ms=1500)]


@pytest.mark.parametrize("text,match", [
    ("commit.before_manifst", "unknown fault point 'commit.before_manifst'"),
    ("write.mid:rank=x", "rank=<int>, local_rank=<int>, nth=<int> or pause=<ms>"),
    ("write.mid:when=3", "rank=<int>, local_rank=<int>, nth=<int> or pause=<ms>"),
    ("write.mid:pause=1.5", "rank=<int>, local_rank=<int>, nth=<int> or pause=<ms>"),
    ("write.mid:nth=0", "nth counts from 1"),
])
def test_bad_fault_specs_are_refused(text, match):
    with pytest.raises(ConfigError, match=match):
        faults.parse(text)


@pytest.fixture
def fake_kill(monkeypatch):
    """Records kills instead of dying, on a process that pretends to be rank 1."""
    kills = []
    monkeypatch.setattr(faults, "_kill", lambda: kills.append(dict(faults._counts)))
    monkeypatch.setattr(faults, "_rank", lambda: 1)
    yield kills
    faults.configure("")


def test_hit_kills_on_the_nth_arrival_on_its_rank(fake_kill):
    faults.configure("write.after:rank=1:nth=3,commit.before_manifest:rank=0,gc.mid")
    assert faults.armed("write.after") and not faults.armed("write.mid")
    for _ in range(5):
        faults.hit("write.after")
    assert fake_kill == [{"write.after": 3}]  # the 3rd arrival only
    faults.hit("commit.before_manifest")  # armed for rank 0; this process is rank 1
    assert len(fake_kill) == 1
    faults.hit("gc.mid")  # no rank given: any rank, first arrival
    assert len(fake_kill) == 2
    faults.configure("")
    faults.hit("write.after")
    assert len(fake_kill) == 2 and not faults.armed("write.after")


def test_unarmed_hit_does_not_even_look_up_the_rank(monkeypatch):
    faults.configure("")

    def boom():
        raise AssertionError("hit() did work with nothing armed")

    monkeypatch.setattr(faults, "_rank", boom)
    monkeypatch.setattr(faults, "_kill", boom)
    for point in faults.POINTS:
        faults.hit(point)


def test_fault_env_is_read(monkeypatch, fake_kill):
    monkeypatch.setenv(faults.ENV, "gc.before:nth=2")
    assert faults.configure() == [faults.FaultSpec("gc.before", None, 2)]
    faults.hit("gc.before")
    faults.hit("gc.before")
    assert len(fake_kill) == 1


def test_local_rank_selects_the_worker_of_a_node(monkeypatch, fake_kill):
    assert faults.parse("write.mid:local_rank=1:nth=2") == [faults.FaultSpec("write.mid", None, 2, 1)]
    monkeypatch.setenv("LOCAL_RANK", "0")
    faults.configure("write.mid:local_rank=1")
    faults.hit("write.mid")
    assert fake_kill == []
    monkeypatch.setenv("LOCAL_RANK", "1")
    faults.configure("write.mid:local_rank=1")
    faults.hit("write.mid")
    assert len(fake_kill) == 1


def test_a_restarted_torchrun_worker_arms_nothing_but_still_checks_the_spec(monkeypatch, fake_kill):
    monkeypatch.setenv(faults.ENV, "gc.before")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.configure() == [] and not faults.armed("gc.before")
    faults.hit("gc.before")
    assert fake_kill == []
    monkeypatch.setenv(faults.ENV, "gc.befor")
    with pytest.raises(ConfigError, match="unknown fault point"):
        faults.configure()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(faults.ENV, "gc.before")
    assert faults.configure() == [faults.FaultSpec("gc.before")]


# ---- kills -------------------------------------------------------------------------

# (group, point, rank, nth[, sync]): every named point once, across the seven groups (consecutive / intermittent
# x fp32 / quantized rows, consecutive with compaction, plain and residual, and plain with memory images), and
# two timer kills.
SCHEDULE = [
    (0, "write.mid", 1, 2),
    (1, "write.after", 0, 1),
    (2, "commit.before_manifest", 0, 2),
    (3, "commit.after_manifest", 0, 1),
    (0, "gc.before", 0, 3, True),  # this job waits for each commit: the training loop hears of it
    (2, "gc.mid", 0, 1),
    (1, "random", 1, 0),
    (3, "random", 0, 0),
    # Group 4 compacts its chain every 2 deltas in the background: a kill in each step of a compaction.
    (4, "compact.after_write", 1, 1),
    (4, "compact.before_manifest", 0, 1),
    (4, "compact.after_manifest", 0, 1),
    # Group 5 folds a residual chain the same way: a kill in the fold, and one right after its commit.
    (5, "compact.after_write", 0, 1),
    (5, "compact.after_manifest", 0, 1),
    # Groups 5 and 6 keep memory images (residual; plain with memory_tier: on): kills at each point of an image
    # update after a commit (the seal removed, half the rows written, every row written but not sealed).
    (5, "image.updated", 1, 2),
    (5, "image.mid", 0, 1),
    (6, "image.unsealed", 1, 2),
    (6, "image.updated", 0, 1, True),
    (6, "compact.after_write", 1, 1),
]


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_kills_at_every_fault_point_restore_the_newest_commit(tmp_path):
    suite = reliability.KillSuite(str(tmp_path / "roots"), str(tmp_path / "side"), saves=5)
    s = suite.run(len(SCHEDULE), schedule=SCHEDULE)
    assert not suite.errors, suite.errors[0]
    assert s["kills"] == len(SCHEDULE)
    assert s["restores_ok"] == len(SCHEDULE) and s["torn_restores"] == 0, s["failures"]
    assert s["lost_commits"] == 0, s["failures"]
    assert s["restart_saves_ok"] == len(SCHEDULE), s["failures"]  # the next save commits, torn dirs are gone
    for t in suite.trials:
        if t.kind not in ("random", "gc.mid"):  # gc.mid fires only if that phase collects garbage
            assert t.fired and t.victim_exit == -9, (t.group, t.kind, t)
        assert t.survivor_exit is not None  # reaped, whatever it was blocked in
    # Restarts took memory images where they were sealed for the newest commit, and a rank killed inside an image
    # update read storage beside a rank that took its image: no restore from an image was wrong.
    assert s["restores_with_a_rank_from_memory"] >= 3 and s["mixed_restores"] >= 1, [
        (t.group, t.kind, t.sources) for t in suite.trials]
    assert s["wrong_restores_from_memory"] == 0
    trials = {t.kind: t for t in suite.trials if t.group < 5}
    # Not vacuous: a half-written rank file was on disk when the fresh ranks restored...
    assert 0 < len(trials["write.mid"].torn_dirs)
    assert max(trials["write.mid"].torn_dirs) > trials["write.mid"].expected
    # ...a commit that nobody had been told of was restored...
    after = trials["commit.after_manifest"]
    assert after.expected is not None and after.expected not in after.reported and after.restored == after.expected
    # ...and a commit survived its rank 0 dying before the index and GC (the job waited for each commit,
    # so rank 1 had normally been told of it before it was reaped).
    gc = trials["gc.before"]
    assert gc.restored == gc.expected and gc.expected >= max(gc.reported)
    assert s["kills_after_a_reported_commit_of_the_newest"] >= 1
    before = trials["commit.before_manifest"]
    assert before.restored == before.expected and max(before.torn_dirs) > before.expected


# ---- single-rank kills ------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_a_single_rank_killed_at_each_commit_point_under_both_launchers_loses_no_committed_file(tmp_path):
    """One rank SIGKILLed, the other left to find out by itself (nobody reaps it), under torchrun's kind of store
    and under a store that lives in rank 0's process: every committed checkpoint keeps every file, and a fresh job
    restores the newest one (reliability.single_rank_kills; make reliability runs every point, 3 rounds)."""
    points = (("write.after", 1), ("commit.before_manifest", 0), ("commit.after_manifest", 0), ("gc.before", 0))
    s = reliability.single_rank_kills(str(tmp_path), 1, points=points)
    assert s["kills"] == 8 and s["fired"] == 8, s
    assert s["committed_missing_a_file"] == 0 and s["torn_restores"] == 0 and s["survivors_hung"] == 0, s["failures"]
    assert s["ok"] == 8, s["failures"]


# ---- a full disk -------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_enospc_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    """ENOSPC half-way through rank 1's file, then on rank 0's manifest: see reliability.enospc_scenario."""
    per_rank = reliability.run_ranks(reliability.enospc_scenario, 2, (str(tmp_path / "root"),), timeout=150)
    expected = {f"{where}: {what}" for where in ("rank file", "manifest")
                for what in ("save failed", "partial files removed", "previous checkpoint still listed",
                             "next save is a committed baseline")}
    expected |= {"restore of the newest checkpoint is exact", "restore of the before the failures checkpoint is exact"}
    for rank, checks in enumerate(per_rank):
        assert set(checks) == expected
        assert all(checks.values()), (rank, {k: v for k, v in checks.items() if not v})
