"""Retention and restore follow the branch a job is on: "newest" is by commit, the same order for both.

A job that goes on from an older step (``restore(step=...)``) writes checkpoints with higher ids and
lower steps than the branch it left. References no one here wrote: the live TorchRec model at each
step (full-precision rows restore it bit for bit), and, for the ordering, orders worked out by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from _toy import build_dmp, local_state, train

SPECS = (("t0", "table_wise"), ("t1", "row_wise"), ("t2", "data_parallel"))
BRANCH_LOG = "starts a new branch below step"


def _build(seed=0):
    from examples.toy import TableSpec

    specs = [TableSpec(name, 200, 8, sharding, "ebc") for name, sharding in SPECS]
    dmp, opt = build_dmp(specs, seed=seed)
    return dmp, specs, opt


def _config(root, policy="consecutive", **kw):
    from cnr_torchrec import load_config

    # Full precision, plain coding: a restore gives back the live model bit for bit.
    quantization = {"method": "none", "state_dtype": "float32", "residual": False}
    return load_config({"root": root, "policy": policy, "quantization": quantization, **kw})


def _steps(root):
    """{id: step} of the committed checkpoints under ``root``."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

    storage = Storage(root)
    try:
        return {i: load_manifest(storage, i).step for i in committed_ids(storage)}
    finally:
        storage.close()


def _assert_equal(got, want, what):
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad[:4]} differ"


def _restore_fresh(root, step=None, **kw):
    """A new model restored from ``root``: (the step restore returned, its state)."""
    from cnr_torchrec import Checkpointer

    dmp, _, opt = _build(seed=7)
    with Checkpointer(dmp, _config(root, **kw), dense_optimizer=opt) as ck:
        got = ck.restore(step)
    return got, local_state(dmp)


def _branch_warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and BRANCH_LOG in r.getMessage()]


# ---- a real job that goes back to step 50 ----------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy,keep", [
    ("consecutive", {"checkpoints": 2}),  # the branch: deltas on step 50's checkpoint, on the first baseline
    # The branch: a new baseline (one_shot after a restore). Its deltas all hang on the baseline, so
    # keeping the newest chain keeps step 50 for the restore, and the branch's baseline makes a new chain.
    ("one_shot", {"checkpoints": 2, "chains": 1}),
])
def test_a_job_that_goes_back_keeps_its_branch_and_restores_it(group, tmp_path, caplog, policy, keep):
    from cnr_torchrec import Checkpointer

    caplog.set_level(logging.INFO, logger="cnr_torchrec")
    root = str(tmp_path / "root")
    dmp, specs, opt = _build()
    gen = torch.Generator().manual_seed(1)
    states, ids = {}, {}
    with Checkpointer(dmp, _config(root, policy, keep=keep), dense_optimizer=opt) as ck:
        for step in range(0, 201, 50):
            train(dmp, specs, opt, 2, gen)
            ids[step] = ck.save(step).wait().id
            states[step] = local_state(dmp)
        assert not _branch_warnings(caplog)

        assert ck.restore(step=50) == 50
        _assert_equal(local_state(dmp), states[50], "restore(step=50)")
        for step in (60, 70, 80):
            train(dmp, specs, opt, 2, gen)
            info = ck.save(step).wait()
            assert info.kind == ("baseline" if (policy, step) == ("one_shot", 60) else "delta")
            assert info.step == step and info.id > ids[200]  # a higher id, a lower step
            ids[step] = info.id
            states[step] = local_state(dmp)
            kept = _steps(root)
            # The branch written now is the newest, whatever its steps: every checkpoint of it stays.
            assert {ids[s] for s in range(60, step + 1, 10)} <= kept.keys(), (step, kept)
    # The branch left behind aged out: two newer commits later, nothing above step 80 is kept.
    kept = _steps(root)
    assert max(kept.values()) == 80 and not {ids[s] for s in (100, 150, 200)} & kept.keys(), kept
    assert len(_branch_warnings(caplog)) == 1, [r.getMessage() for r in _branch_warnings(caplog)]
    assert f"checkpoint {ids[60]} (step 60) starts a new branch below step 200" in _branch_warnings(caplog)[0].message

    got, restored = _restore_fresh(root, policy=policy)
    assert got == 80
    _assert_equal(restored, states[80], "restore() after the branch vs the live model at step 80")


@pytest.mark.timeout(120)
def test_a_fresh_job_into_a_used_root_warns_at_its_first_commit_and_keeps_its_checkpoints(group, tmp_path, caplog):
    """The first commit of a Checkpointer loads the catalog from the root (the new checkpoint in it)."""
    from cnr_torchrec import Checkpointer

    caplog.set_level(logging.INFO, logger="cnr_torchrec")
    root = str(tmp_path / "root")
    dmp, specs, opt = _build()
    gen = torch.Generator().manual_seed(3)
    with Checkpointer(dmp, _config(root, keep={"checkpoints": 2}), dense_optimizer=opt) as ck:
        for step in (100, 200):
            train(dmp, specs, opt, 2, gen)
            ck.save(step).wait()
    dmp, specs, opt = _build(seed=5)  # started afresh, without a restore
    with Checkpointer(dmp, _config(root, keep={"checkpoints": 2}), dense_optimizer=opt) as ck:
        for step in (0, 10):
            train(dmp, specs, opt, 2, gen)
            assert ck.save(step).wait().id >= 2
        live = local_state(dmp)
    assert sorted(_steps(root).values()) == [0, 10]
    assert [r.message for r in _branch_warnings(caplog)] == [
        "checkpoint 2 (step 0) starts a new branch below step 200, the highest step under the root: retention "
        "keeps by commit, so it keeps this branch and collects the other one as it ages out, and restore() with "
        "no step restores this branch"]
    got, restored = _restore_fresh(root)
    assert got == 10
    _assert_equal(restored, live, "restore() vs the fresh job at step 10")


# ---- a compacted root: retention and restore agree on the newest ---------------------------------


@pytest.mark.timeout(120)
def test_retention_and_restore_take_the_same_newest_on_a_compacted_root(group, tmp_path, caplog):
    """``cnr compact`` of an older tip writes a baseline whose id is higher than the deltas after that tip."""
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.compact.offline import compact
    from cnr_torchrec.ckpt.config import KeepConfig
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.restore.resolve import resolve_chain
    from cnr_torchrec.ckpt.retention import Catalog
    from cnr_torchrec.ckpt.tools.root import resolve_id

    caplog.set_level(logging.INFO, logger="cnr_torchrec")
    root = str(tmp_path / "root")
    dmp, specs, opt = _build()
    gen = torch.Generator().manual_seed(2)
    states = {}
    with Checkpointer(dmp, _config(root, keep={"chains": 10}), dense_optimizer=opt) as ck:
        for step in (10, 20, 30, 40):  # ids 0..3, one chain
            train(dmp, specs, opt, 2, gen)
            ck.save(step).wait()
            states[step] = local_state(dmp)
    storage = Storage(root)
    try:
        assert compact(storage, 1).equals == 1  # checkpoint 4: step 20's state, after 2 and 3 in state
        catalog = Catalog.load(storage)
        assert catalog.newest_first() == [3, 2, 4, 1, 0]
        assert catalog.retained(KeepConfig(checkpoints=1)) == {0, 1, 2, 3}  # step 40's chain, not 4
        assert resolve_chain(storage, None, {}, fail=True)[0].chain == (0, 1, 2, 3)
        assert resolve_chain(storage, 20, {}, fail=True)[0].chain == (4,)  # of its step: the shorter chain
        assert resolve_id(storage) == 3  # what `cnr export` and `cnr compact` take with no id: restore's newest
    finally:
        storage.close()

    # A job goes on from the newest (step 40) with keep 1: it continues that chain, and the compacted
    # baseline, which holds an older state, is what retention collects. Nothing branched.
    with Checkpointer(dmp, _config(root, keep={"checkpoints": 1}), dense_optimizer=opt) as ck:
        assert ck.restore() == 40
        train(dmp, specs, opt, 2, gen)
        assert ck.save(50).wait().parent == 3
        states[50] = local_state(dmp)
    assert sorted(_steps(root).items()) == [(0, 10), (1, 20), (2, 30), (3, 40), (5, 50)]
    assert not _branch_warnings(caplog)
    got, restored = _restore_fresh(root)
    assert got == 50
    _assert_equal(restored, states[50], "restore() vs the live model at step 50")


# ---- the shared order, on its own -----------------------------------------------------------------


@dataclass(frozen=True)
class _Ckpt:
    id: int
    equals: int | None = None


def _order(ckpts, ids=None, leave_out=()):
    from cnr_torchrec.ckpt.format.commits import newest_state_first

    by_id = {c.id: c for c in ckpts}
    ids = sorted(by_id) if ids is None else ids
    return [c.id for c in newest_state_first(ids, lambda i: None if i in leave_out else by_id.get(i))]


def test_newest_state_first_puts_a_compacted_baseline_right_before_its_tip():
    plain = [_Ckpt(i) for i in range(5)]
    assert _order(plain) == [4, 3, 2, 1, 0]  # commit order, whatever the steps
    assert _order(plain + [_Ckpt(5, equals=2)]) == [4, 3, 5, 2, 1, 0]  # 3 and 4 hold newer state than 2
    assert _order(plain[:3] + [_Ckpt(3, equals=2)]) == [3, 2, 1, 0]  # right after its tip: first (the shorter)
    # Two compactions, each before its own tip.
    assert _order([_Ckpt(i) for i in range(6)] + [_Ckpt(6, equals=2), _Ckpt(7, equals=4)]) == [5, 7, 4, 3, 6, 2, 1, 0]
    # A checkpoint left out (unsound) still lies between tip and compaction; a collected tip moves it down.
    assert _order(plain + [_Ckpt(5, equals=2)], leave_out={3}) == [4, 5, 2, 1, 0]
    assert _order([_Ckpt(i) for i in (0, 1, 3, 4)] + [_Ckpt(5, equals=2)]) == [4, 3, 5, 1, 0]


def test_newest_state_first_loads_lazily_newest_id_first():
    from cnr_torchrec.ckpt.format.commits import newest_state_first

    loaded = []

    def load(i):
        loaded.append(i)
        return _Ckpt(i, equals=1 if i == 4 else None)

    it = newest_state_first([0, 1, 2, 3, 4], load)
    assert next(it).id == 3 and loaded == [4, 3]  # 4 is deferred behind 2 and 3; 0..2 are not read
    assert [c.id for c in it] == [2, 4, 1, 0] and loaded == [4, 3, 2, 1, 0]


# ---- the catalog: chains and the branch warning ---------------------------------------------------


def _entry(i, step, parent=None, base=None, equals=None, nbytes=10):
    from cnr_torchrec.ckpt.retention import Entry

    kind = "delta" if parent is not None else "baseline"
    return Entry(i, step, kind, parent, i if base is None else base, nbytes, 1, equals=equals)


def test_keep_chains_keeps_the_chain_the_job_writes_to():
    from cnr_torchrec.ckpt.config import KeepConfig
    from cnr_torchrec.ckpt.retention import Catalog

    # Branch A: chain 0..3, compacted into 4 (equals 3), delta 5 on it at step 200. Branch B goes on from
    # checkpoint 1 (step 50) with deltas 6 and 7 on base 0: the chain written now is base 0, not base 4.
    catalog = Catalog([_entry(0, 0), _entry(1, 50, 0, 0), _entry(2, 100, 1, 0), _entry(3, 150, 2, 0),
                       _entry(4, 150, equals=3), _entry(5, 200, 4, 4), _entry(6, 60, 1, 0), _entry(7, 70, 6, 0)])
    assert catalog.newest_first()[:2] == [7, 6]
    assert catalog.retained(KeepConfig(chains=1)) == {0, 1, 2, 3, 6, 7}
    assert catalog.retained(KeepConfig(checkpoints=2)) == {0, 1, 6, 7}


def test_the_branch_warning_names_a_branch_once_and_never_a_compaction():
    from cnr_torchrec.ckpt.retention import Catalog

    catalog = Catalog([_entry(0, 0), _entry(1, 50, 0, 0), _entry(2, 100, 1, 0), _entry(3, 200, 2, 0)])
    seen = []
    for e in [_entry(4, 60, 1, 0),  # back to step 50, deltas: a branch
              _entry(5, 70, 4, 0),  # goes on
              _entry(7, 80, 5, 0),  # a compaction of 0..5 took id 6; the chain goes on while it runs
              _entry(6, 70, equals=5),  # the compaction commits: its tip's step, below the newest's (80)
              _entry(8, 90, 6, 6),  # the delta that hangs on the compaction
              _entry(9, 90, equals=8),  # a compaction of 6..8 (id 9) commits at once: it is the newest
              _entry(10, 95, 8, 6),  # the delta written meanwhile, on the chain it folds
              _entry(11, 97, 9, 9),  # the delta that hangs on it
              _entry(12, 30),  # a fresh baseline at step 30 (policy full): a branch
              _entry(13, 40),  # the next baseline goes on
              _entry(14, 110, 2, 0)]:  # back onto the first branch's step 100 (above the newest, 40): a branch
        catalog.entries[e.id] = e
        seen.append(catalog.branch_below(e))
    assert seen == [200] + [None] * 7 + [200, None, 200]  # in the order committed
