"""A chain applied to one rank's model state (``cnr_torchrec/ckpt/restore/chain.py``: ``restore_chain``).

``restore_chain`` is called here directly, on chains the real ``Checkpointer`` wrote for the toy model (a row-wise,
a column-wise and a data_parallel EBC table, a table-wise EC table, FBGEMM's EXACT_ROWWISE_ADAGRAD, torch's Adam
for the dense part, a reader position as ``extra_state``). The references are the saving model's own state at the
last save, bit for bit: its shards and their optimizer state, its dense parameters, Adam's state, the TBE step
counters, the reader position and torch's RNG; for a residual chain, the chain's rule computed with torch ops from
the stored entries (``test_restore_apply.rule_reference``: each row's newest whole copy plus the newer residuals,
added oldest first).

``restore_chain`` is exercised through ``Checkpointer.restore`` elsewhere: every policy and codec
(``test_checkpointer_multirank.py``), TorchRec's models across plans and world sizes (``test_torchrec_models.py``),
a restore that fails part way and its rollback (``test_restore_outcomes.py``), memory images
(``test_memory_tier.py``), dense optimizers (``test_dense_optimizers.py``), managed-collision tables
(``test_managed_collision.py``, ``test_mc_mutations.py``) and partial recovery (``test_partial_recovery.py``).
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from _format_checks import flip_bytes
from _toy import Reader, build_dmp, local_state, train
from test_restore_apply import rule_reference

from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest, walk_chain
from cnr_torchrec.ckpt.job_state import JobState
from cnr_torchrec.ckpt.restore.chain import RestoreOptions, restore_chain
from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError

PLAIN = {"method": "none", "residual": False}
RESIDUAL = {"method": "adaptive", "bits": 4, "residual": True}


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 40, 8, "column_wise"),
            TableSpec("t2", 32, 4, "table_wise", "ec"), TableSpec("dp", 24, 4, "data_parallel")]


def _everything(dmp, opt, reader) -> dict:
    """What a restore gives back, copied: shards and their optimizer state, dense parameters, the dense
    optimizer's state, the TBE step counters and the reader position."""
    out = local_state(dmp)
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[("adam", i, k)] = v.clone() if torch.is_tensor(v) else v
    for j, tbe in enumerate(dmp.dirty_tracker.tbes()):
        it = getattr(tbe, "iter", None)
        if isinstance(it, torch.Tensor):
            out[("iter", j)] = it.clone()
    out["reader"] = reader.pos.clone()
    return out


def _differ(got: dict, want: dict) -> list:
    assert got.keys() == want.keys(), sorted(map(str, got.keys() ^ want.keys()))
    return [k for k in want if not (torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k])]


def _write(root: str, quantization: dict, saves: int = 4):
    """A baseline and deltas by the real Checkpointer. Returns the state at the last save and torch's RNG."""
    from cnr_torchrec import Checkpointer, load_config

    specs = _specs()
    dmp, opt = build_dmp(specs)
    reader = Reader()
    gen = torch.Generator().manual_seed(0)
    config = load_config({"root": root, "policy": "consecutive", "keep_last": 10, "quantization": quantization})
    with Checkpointer(dmp, config, dense_optimizer=opt, extra_state={"reader": reader}) as ck:
        for step in range(1, saves + 1):
            train(dmp, specs, opt, 2, gen)
            reader.pos.fill_(100 * step)
            torch.manual_seed(step)
            rng = torch.get_rng_state()
            ck.save(step).wait()
    return _everything(dmp, opt, reader), rng


@pytest.fixture(scope="module")
def plain(group, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("plain") / "root")
    return (root, *_write(root, PLAIN))


def _chain(storage: Storage) -> list:
    return walk_chain(load_manifest(storage, committed_ids(storage)[-1]), lambda i: load_manifest(storage, i))


def _fresh():
    dmp, opt = build_dmp(_specs(), seed=7)
    return dmp, opt, Reader()


def _restore(root: str, dmp, opt, reader, **kw):
    storage = Storage(root)
    try:
        job = JobState(dmp, dmp.dirty_tracker, opt, {"reader": reader})
        return restore_chain(_chain(storage), job, storage=storage, rank=0, world_size=1,
                             options=RestoreOptions(**kw))
    finally:
        storage.close()


def test_a_chain_gives_back_the_rows_dense_and_per_rank_state_and_the_rng_only_when_asked(plain):
    root, want, rng = plain
    dmp, opt, reader = _fresh()
    torch.manual_seed(1234)
    mine = torch.get_rng_state()
    staged = _restore(root, dmp, opt, reader)
    assert staged.entries == []  # not staged: every row is in the model already
    assert _differ(_everything(dmp, opt, reader), want) == []
    assert torch.equal(torch.get_rng_state(), mine)  # the job's RNG, untouched

    dmp, opt, reader = _fresh()
    _restore(root, dmp, opt, reader, rng=True)
    assert _differ(_everything(dmp, opt, reader), want) == []
    assert torch.equal(torch.get_rng_state(), rng)  # the saving job's, where it stood at the last save


def _restore_staged(root: str, dmp, opt, reader, buffers=None, stats=None):
    """A staged restore (``stage``, as ``restore_rollback`` does), its storage left open for the commit.
    Returns the staged weights and the storage to close."""
    storage = Storage(root)
    job = JobState(dmp, dmp.dirty_tracker, opt, {"reader": reader})
    staged = restore_chain(_chain(storage), job, storage=storage, rank=0, world_size=1, buffers=buffers,
                           options=RestoreOptions(stage=True, stats=stats))
    return staged, storage


def _is_table_state(key) -> bool:
    """A shard's weights or its fused optimizer state (what ``local_state`` names ``(table, shard, ...)``)."""
    return isinstance(key, tuple) and key[0] not in ("adam", "iter")


def test_a_staged_plain_chain_writes_no_table_before_its_commit_and_makes_no_host_copy(plain):
    root, want, _ = plain
    dmp, opt, reader = _fresh()
    before = _everything(dmp, opt, reader)
    stats: dict[str, float] = {}
    staged, storage = _restore_staged(root, dmp, opt, reader, stats=stats)
    try:
        now = _everything(dmp, opt, reader)
        tables = {k for k in want if _is_table_state(k)}
        # Every byte was read and checked, and no shard's weights or optimizer state were written yet.
        assert [k for k in tables if not torch.equal(now[k], before[k])] == []
        assert stats["check_rows_ms"] >= 0 and stats["bytes_read"] > 0
        assert stats["staged_copy_bytes"] == 0  # no host copy of a shard: the rows are decoded in place
        assert staged.by_key() == {}
        # The rest (dense parameters, Adam's state, the TBE counters, per-rank state) is written at once.
        assert [k for k in want if k not in tables and not torch.equal(now[k], want[k])] == []
        staged.commit()
    finally:
        storage.close()
    assert _differ(_everything(dmp, opt, reader), want) == []


def test_a_staged_plain_chain_stages_into_the_buffers_it_is_given(plain):
    # A residual job's reconstruction (given as buffers) restoring a plain chain: its shards are staged into
    # those rows, which hold the restored weights after the commit; the others are decoded in place.
    root, want, _ = plain
    dmp, opt, reader = _fresh()
    tracker = dmp.dirty_tracker
    keys = {(t, s.rows, s.cols): (t, i, "w") for t in tracker.tables() for i, (_, s) in enumerate(tracker.shards(t))}
    given = dict(list(keys.items())[:2])
    buffers = {k: torch.full_like(want[name], float("nan")) for k, name in given.items()}
    before = _everything(dmp, opt, reader)
    stats: dict[str, float] = {}
    staged, storage = _restore_staged(root, dmp, opt, reader, buffers=buffers, stats=stats)
    try:
        assert [k for k in want if _is_table_state(k) and not torch.equal(_everything(dmp, opt, reader)[k],
                                                                          before[k])] == []
        assert stats["staged_copy_bytes"] == 0  # the buffers are no new memory
        staged.commit()
    finally:
        storage.close()
    by_key = staged.by_key()
    assert set(by_key) == set(given)
    assert all(by_key[k] is buffers[k] and torch.equal(by_key[k], want[given[k]]) for k in given)
    assert _differ(_everything(dmp, opt, reader), want) == []


def _damage_rows(root: str, ckpt: int) -> None:
    """Flips a byte in every 256 of checkpoint ``ckpt``'s rank file: its rows fail their CRCs."""
    flip_bytes(os.path.join(root, f"ckpt-{ckpt:08d}", "rank-00000.bin"), every=256)


@pytest.mark.parametrize("stage", [True, False], ids=["staged", "in_place"])
def test_a_chain_that_fails_part_way_raises_and_a_staged_one_leaves_the_weights_as_they_were(plain, tmp_path,
                                                                                            stage):
    root, want, _ = plain
    damaged = str(tmp_path / "root")
    shutil.copytree(root, damaged)
    storage = Storage(damaged)
    baseline = _chain(storage)[0].id
    storage.close()
    _damage_rows(damaged, baseline)  # read last: the deltas' rows are applied before it fails
    dmp, opt, reader = _fresh()
    before = _everything(dmp, opt, reader)
    with pytest.raises(CorruptCheckpointError):
        _restore(damaged, dmp, opt, reader, stage=stage)
    now = _everything(dmp, opt, reader)
    changed = {k for k in _differ(now, before)}
    weights = {k for k in changed if isinstance(k, tuple) and k[-1] == "w"}
    dense = {k for k in changed if isinstance(k, str) or k[0] in ("adam", "iter")}
    assert not dense, sorted(map(str, dense))  # dense and per-rank state come after the rows: never reached
    if stage:
        assert not weights, sorted(map(str, weights))
    else:  # the control: the same failure written in place leaves rows of the deltas behind
        assert weights, "the in-place restore changed no weights before it failed"


def test_a_residual_chain_is_summed_oldest_copy_first(group, tmp_path):
    root = str(tmp_path / "root")
    _write(root, RESIDUAL, saves=5)
    storage = Storage(root)
    reference = rule_reference(storage, _chain(storage), {s.name: (s.rows, s.dim) for s in _specs()})
    storage.close()
    dmp, opt, reader = _fresh()
    _restore(root, dmp, opt, reader)
    tracker = dmp.dirty_tracker
    for t in ("t0", "t1", "t2", "dp"):
        for k, s in tracker.shards(t):
            got = k.tbe.split_embedding_weights()[s.local_index]
            ref = reference[t][s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]]
            assert torch.equal(got, ref), (t, s.cols, int((got != ref).sum()), (got - ref).abs().max())


def test_extra_state_the_checkpoint_lacks_is_refused_by_name(plain):
    root, want, _ = plain
    dmp, opt, reader = _fresh()
    storage = Storage(root)
    try:
        with pytest.raises(IncompatibleCheckpointError, match=r"extra_state \['other'\] is not in checkpoint"):
            job = JobState(dmp, dmp.dirty_tracker, opt, {"reader": reader, "other": copy.deepcopy(reader)})
            restore_chain(_chain(storage), job, storage=storage, rank=0, world_size=1)
    finally:
        storage.close()


def test_without_replicated_state_only_the_sharded_tables_are_restored(plain):
    """Partial recovery's form: data_parallel tables, dense parameters and the dense optimizer are left to the
    caller (it takes them from a surviving rank)."""
    root, want, _ = plain
    dmp, opt, reader = _fresh()
    before = _everything(dmp, opt, reader)
    _restore(root, dmp, opt, reader, replicated=False)
    now = _everything(dmp, opt, reader)
    sharded = {k for k in want if isinstance(k, tuple) and k[0] in ("t0", "t1", "t2")}
    assert [k for k in sharded if not torch.equal(now[k], want[k])] == []
    rest = {k for k in before if k not in sharded and k != "reader"}  # dp's rows, dense, the step counters
    assert {k for k in now if k not in sharded and k != "reader"} == rest  # no Adam state either
    assert any(k[0] == "dp" for k in rest if isinstance(k, tuple)) and any(isinstance(k, str) for k in rest)
    assert [k for k in rest if not torch.equal(now[k], before[k])] == []
    assert [k for k in rest if not torch.equal(want[k], before[k])] != []  # the checkpoint's differ from these
    assert torch.equal(now["reader"], want["reader"])  # per-rank state is this rank's own: restored
