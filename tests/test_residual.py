"""quantization.residual: deltas coded against what the chain restores, restored by adding up.

The reference is built here from the codec's public encode/decode and the live weights at
each save: a baseline row restores as decode(encode(x)); a row a delta writes restores as
r + decode(encode(x - r)), r being what it restored before. Which rows a delta wrote comes
from the tracker (the manifest's ids), whose verdicts other tests check against diffed weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist import run_ranks
from _toy import build_dmp, train

from cnr_torchrec.errors import ConfigError



def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _weights(dmp):
    tracker = dmp.dirty_tracker
    return {(t, tuple(s.rows), tuple(s.cols)): k.tbe.split_embedding_weights()[s.local_index].detach().clone()
            for t in tracker.tables() for k, s in tracker.shards(t)}


def _written(root, ckpt_id):
    """(table, rows, cols) -> the shard rows checkpoint ``ckpt_id`` wrote (None: all), and whether as residuals."""
    from cnr_torchrec.ckpt.format.bytes.chunks import PayloadReader
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import load_manifest
    from cnr_torchrec.ckpt.format.row_ids import decode_ids

    storage = Storage(root)
    try:
        m = load_manifest(storage, ckpt_id)
        out = {}
        for report in m.ranks:
            load = PayloadReader(storage, report.payload)
            for table, e in report.entries():
                ids = decode_ids(e.ids.kind, load(e.ids.blob), e.num_rows) if e.ids is not None else None
                out[(table, e.rows, e.cols)] = (ids, e.residual)
        return out
    finally:
        storage.close()


def _follow(expected, written, live, before=None):
    """The reference after a residual delta: each written row becomes _coded(before, live), ``before`` being
    what the chain restored until then (default: ``expected`` as it stands)."""
    assert any(residual for _, residual in written.values()), written
    _follow_entries(expected, written, live, before, delta=True)


def _roundtrip(x, bits=4):
    """What the chain restores of rows ``x`` stored by adaptive ``bits``-bit: the codec's own encode, then decode."""
    from cnr_torchrec.quant import get_codec

    codec = get_codec("adaptive", bits)
    return codec.decode(codec.encode(x.float().contiguous()))


def _coded(before, x, bits=4):
    """What a residual delta restores for rows ``x`` that the chain restored as ``before``: each row as a residual,
    before + _roundtrip(x - before), or whole, _roundtrip(x), whichever lands closer to ``x`` (by its sum of
    squared errors, which adaptive's grid search minimizes; a tie keeps the residual)."""
    as_residual, as_whole = before + _roundtrip(x - before, bits), _roundtrip(x, bits)
    closer = (as_whole - x).square().sum(1) < (as_residual - x).square().sum(1)
    return torch.where(closer.unsqueeze(1), as_whole, as_residual)


def _assert_restored(got, expected):
    for key, want in expected.items():
        torch.testing.assert_close(got[key], want, rtol=0, atol=1e-6, msg=lambda m: f"{key}: {m}")


def _assert_fresh_restore(root, specs, seed, step, expected):
    """A fresh model (init ``seed``) restores checkpoint ``step`` of the residual chain as ``expected``."""
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(specs, seed=seed)
    with Checkpointer(dmp, _residual_config(root), dense_optimizer=opt) as ck:
        assert ck.restore() == step
        _assert_restored(_weights(dmp), expected)


def _residual_worker(rank, world_size, root):
    from cnr_torchrec import Checkpointer

    specs, config = _specs(), _residual_config(root)
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in range(1, 5):
            train(dmp, specs, opt, 2, gen)
            info = ck.save(step).wait()
            live, written = _weights(dmp), _written(root, info.id)
            if step == 1:  # the baseline: every row whole
                assert not any(residual for _, residual in written.values())
                expected = {key: _roundtrip(live[key]) for key in written}
            else:
                _follow(expected, written, live)
    fresh, opt2 = build_dmp(specs, seed=1)
    with Checkpointer(fresh, config, dense_optimizer=opt2) as ck:
        assert ck.restore() == 4
        got = _weights(fresh)
        _assert_restored(got, expected)
        # The reconstruction restarts from what was restored: the next delta is coded against it.
        train(fresh, specs, opt2, 2, gen)
        info = ck.save(5).wait()
        _follow(expected, _written(root, info.id), _weights(fresh), got)
    _assert_fresh_restore(root, specs, 2, 5, expected)
    _offline_tools(root, expected)


def _offline_tools(root, expected):
    """cnr export adds the residuals up as a restore does; `cnr compact` folds the chain into a float32
    baseline of the sums, which exports to the same bits and which a job then resumes from."""
    from cnr_torchrec.ckpt.compact.offline import compact
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.export import export_state_dict

    def assert_exported(state):
        for (table, rows, cols), want in expected.items():
            (name,) = [k for k in state if k.endswith(f".{table}.weight")]
            torch.testing.assert_close(state[name][rows[0]:rows[1], cols[0]:cols[1]], want, rtol=0, atol=1e-6)

    storage = Storage(root)
    try:
        chain = export_state_dict(storage)  # the newest: step 5
        assert_exported(chain)
        body = compact(storage)
        assert body.kind == "baseline" and body.codec["method"] == "none"
        folded = export_state_dict(storage, body.id)
        assert folded.keys() == chain.keys() and all(torch.equal(folded[k], chain[k]) for k in chain)
    finally:
        storage.close()
    # A job resumes from the float32 baseline and goes on writing residual deltas against it.
    from cnr_torchrec import Checkpointer

    specs = _specs()
    dmp, opt = build_dmp(specs, seed=7)
    with Checkpointer(dmp, _residual_config(root), dense_optimizer=opt) as ck:
        assert ck.restore() == 5
        _assert_restored(_weights(dmp), expected)
        train(dmp, specs, opt, 1, torch.Generator().manual_seed(3))
        info = ck.save(6).wait()
        assert info.kind == "delta"
        _follow(expected, _written(root, info.id), _weights(dmp))
    _assert_fresh_restore(root, specs, 8, 6, expected)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_residual_deltas_restore_as_the_closed_loop_reference(tmp_path):
    run_ranks(_residual_worker, world_size=1, timeout=100, args=(str(tmp_path / "ck"),))


@pytest.mark.parametrize("cfg,match", [
    ({"policy": "one_shot"}, "policy 'one_shot'"),
    ({"quantization": {"method": "fp16", "residual": True}}, "does not quantize"),
])
def test_residual_refuses_what_it_cannot_code(cfg, match):
    from cnr_torchrec import load_config

    quant = cfg.pop("quantization", {"method": "adaptive", "bits": 4, "residual": True})
    with pytest.raises(ConfigError, match=match):
        load_config({"root": "/tmp/unused", "quantization": quant, **cfg})


# ---------------------------------------------------------------------- background compaction (the fold)

def _fold_config(root, **kw):
    from cnr_torchrec import load_config

    return load_config({"root": root, "keep": {"chains": 20}, "compaction": {"max_chain": 3},
                        "quantization": {"method": "adaptive", "bits": 4, "residual": True}, **kw})


def _follow_entries(expected, written, live, against=None, *, delta):
    """The closed-loop reference after any save of the job: a baseline's rows restore as _roundtrip(x), a
    delta's as _coded(r, x), r being what the parent's chain restores: ``against`` (what the folded baseline
    restores, for the delta that hangs on a fold: every row of the reference becomes it first), else
    ``expected``."""
    if against is not None:
        expected.update({k: against[k].clone() for k in expected})
    for key, (ids, residual) in written.items():
        rows = torch.arange(live[key].shape[0]) if ids is None else ids
        assert not residual or delta, key
        if delta:
            expected[key][rows] = _coded(expected[key][rows], live[key][rows])
        else:
            expected.setdefault(key, torch.full_like(live[key], float("nan")))[rows] = _roundtrip(live[key][rows])


def _fold_job(root, specs, saves, **kw):
    """A residual job that compacts in the background, each fold joined at the save after it (deterministic).
    Returns (kinds the trainer wrote, the closed-loop reference, the last step)."""
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(4)
    expected, kinds, history = {}, [], {}
    with Checkpointer(dmp, _fold_config(root, **kw), dense_optimizer=opt) as ck:
        for step in range(1, saves + 1):
            train(dmp, specs, opt, 2, gen)
            info = ck.save(step).wait()
            kinds.append(info.kind)
            written, tip = _written(root, info.id), _at_fold_tip(root, info, history, specs)
            if tip is not None:  # the first delta on a fold: residuals against the fold's tip
                assert any(residual for _, residual in written.values()), info
            _follow_entries(expected, written, _weights(dmp), tip, delta=info.kind == "delta")
            history[info.id] = {k: v.clone() for k, v in expected.items()}
            ck.wait(compaction=True)
    return kinds, expected, saves


def _at_fold_tip(root, info, history, specs):
    """What the folded baseline ``info`` hangs on restores (None unless it is the first delta on a fold): a
    fresh model restores it from a copy of the root that holds it and its chain alone."""
    import os
    import shutil
    import tempfile

    if info.kind != "delta" or len(info.chain) != 2 or info.chain[0] in history:
        return None
    fold_id = info.chain[0]
    with tempfile.TemporaryDirectory() as tmp:
        alone = os.path.join(tmp, "ck")
        shutil.copytree(root, alone, ignore=lambda d, names: [n for n in names if n.startswith("ckpt-")
                                                               and n != f"ckpt-{fold_id:08d}"])
        os.remove(os.path.join(alone, "index.json"))
        return _restore_state(alone, specs)[2]


def _restore_state(root, specs, step=None):
    from _toy import local_state

    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(specs, seed=9)
    with Checkpointer(dmp, _fold_config(root), dense_optimizer=opt) as ck:
        got = ck.restore(step)
        return got, local_state(dmp), _weights(dmp)


def test_a_residual_chain_is_folded_in_the_background_and_the_closed_loop_holds(group, tmp_path):
    """Folds of a residual chain while the job goes on: each folded baseline restores what the chain it folded
    restores, its weights as adaptive 8-bit's image of them and its optimizer state bit for bit; after the
    folds the job's deltas still restore as the closed-loop reference, and the chain stays bounded."""
    import os
    import shutil

    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

    root = str(tmp_path / "ck")
    specs = _plan_specs(PLAN_A)
    kinds, expected, step = _fold_job(root, specs, 11)
    assert kinds == ["baseline"] + ["delta"] * 10  # the trainer wrote one baseline; folds wrote the others
    storage = Storage(root)
    try:
        bodies = {i: load_manifest(storage, i).body for i in committed_ids(storage)}
    finally:
        storage.close()
    folded = {i: b for i, b in bodies.items() if b.get("equals") is not None}
    assert len(folded) >= 2, sorted(bodies)
    assert all(b["codec"] == {"method": "adaptive", "bits": 8, "params": {}} for b in folded.values())
    assert max(b["depth"] for b in bodies.values()) <= 4
    newest = max(bodies.values(), key=lambda b: (b["step"], b["id"]))
    assert newest["kind"] == "delta" and newest["base"] in folded

    got, _, weights = _restore_state(root, specs)
    assert got == step
    _assert_restored(weights, expected)
    for c, body in folded.items():
        tip = bodies[body["equals"]]
        without = str(tmp_path / f"without-{c}")
        shutil.copytree(root, without)
        shutil.rmtree(os.path.join(without, f"ckpt-{c:08d}"))
        os.remove(os.path.join(without, "index.json"))
        from_fold, from_chain = _restore_state(root, specs, tip["step"]), _restore_state(without, specs, tip["step"])
        assert from_fold[0] == from_chain[0] == tip["step"]
        exact = {s.name for s in specs if s.sharding == "data_parallel"}  # stored whole and exact by every save
        want = {k: _roundtrip(v, bits=8) if k[2] == "w" and k[0] not in exact else v for k, v in from_chain[1].items()}
        bad = [k for k in want if not torch.equal(from_fold[1][k], want[k])]
        assert not bad, f"fold {c} vs chain {body['compacted_from']}: {bad[:4]} differ"


def test_a_fold_that_fails_leaves_the_residual_chain_going_on(group, tmp_path, monkeypatch):
    """A fold that fails part way (as a rank killed in it would leave it): nothing of it is left, the deltas go
    on against the old chain, and a restore right after is the closed-loop reference."""
    import os

    from cnr_torchrec.ckpt.compact import fold

    def broken(*args, **kwargs):
        raise OSError("disk gone while folding")

    monkeypatch.setattr(fold, "fold_rank", broken)
    root = str(tmp_path / "ck")
    specs = _plan_specs(PLAN_A)
    kinds, expected, step = _fold_job(root, specs, 6)
    assert kinds == ["baseline"] + ["delta"] * 5
    dirs = sorted(d for d in os.listdir(root) if d.startswith("ckpt-"))
    assert len(dirs) == 6, dirs  # the trainer's checkpoints only
    got, _, weights = _restore_state(root, specs)
    assert got == step
    _assert_restored(weights, expected)


def test_retention_collects_folded_residual_chains_and_every_kept_checkpoint_restores(group, tmp_path):
    """keep: {checkpoints: 2} under folds: the root holds the newest two checkpoints and what they need (the
    last fold and its deltas, and the chain a fold in flight reads), and each restores as the closed-loop
    reference stood at its save."""
    import os

    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root = str(tmp_path / "ck")
    specs = _plan_specs(PLAN_A)

    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(6)
    expected, at_step, history = {}, {}, {}
    config = _fold_config(root, keep={"checkpoints": 2}, compaction={"max_chain": 2})
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in range(1, 11):
            train(dmp, specs, opt, 2, gen)
            info = ck.save(step).wait()
            _follow_entries(expected, _written(root, info.id), _weights(dmp), _at_fold_tip(root, info, history, specs),
                            delta=info.kind == "delta")
            history[info.id] = {k: v.clone() for k, v in expected.items()}
            at_step[step] = {k: v.clone() for k, v in expected.items()}
            ck.wait(compaction=True)
    storage = Storage(root)
    try:
        kept = committed_ids(storage)
        steps = {i: _step_of(storage, i) for i in kept}
        folds = {i for i in kept if load_manifest(storage, i).equals is not None}
    finally:
        storage.close()
    assert len(kept) <= 5 and min(kept) >= 7, kept  # every earlier chain is gone
    assert sorted(d for d in os.listdir(root) if d.startswith("ckpt-")) == [f"ckpt-{i:08d}" for i in kept]
    assert folds, kept
    for i, step in steps.items():
        got, _, weights = _restore_state(root, specs, step)
        assert got == step
        # At a fold's step a restore takes the fold (before its tip): the reference at 8 bits.
        (_assert_folded if step in {steps[f] for f in folds} else _assert_restored)(weights, at_step[step])


def _assert_folded(got, expected):
    """``got`` is the folded baseline's restore of the rows ``expected``: adaptive 8-bit's image of them, but for
    an element whose sum (added up in another order, within 1e-6) fell on the other side of a rounding edge,
    one step off."""
    from cnr_torchrec.quant import get_codec

    codec = get_codec("adaptive", 8)
    for key, want in expected.items():
        encoded = codec.encode(want.float().contiguous())
        step = encoded.scale.float().unsqueeze(1).expand_as(want)
        off = (got[key] - codec.decode(encoded)).abs()
        assert bool((off <= step * 1.001 + 1e-6).all()), f"{key}: {int((off > step * 1.001 + 1e-6).sum())} elements"
        assert int((off > 1e-6).sum()) <= want.numel() // 50, f"{key}: {int((off > 1e-6).sum())} elements off a step"


def _step_of(storage, ckpt_id):
    from cnr_torchrec.ckpt.format.commits import load_manifest

    return load_manifest(storage, ckpt_id).step


PLAN_A = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
PLAN_B = ("row_wise", "column_wise", "table_row_wise", "data_parallel", "table_wise")


def _plan_specs(plan):
    from examples.toy import TableSpec

    return [TableSpec(f"t{i}", 96, 8, st, "ebc") for i, st in enumerate(plan)]


def _default_config(root):
    """The defaults (adaptive 4-bit, residual: auto), keeping the whole chain."""
    from cnr_torchrec import load_config

    return load_config({"root": root, "keep_last": 10})


def _residual_config(root):
    from cnr_torchrec import load_config

    return load_config({"root": root, "keep_last": 10,
                        "quantization": {"method": "adaptive", "bits": 4, "residual": True}})


def _write_plan_a(rank, world_size, root):
    from cnr_torchrec import Checkpointer

    specs = _plan_specs(PLAN_A)
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(10 + rank)
    with Checkpointer(dmp, _residual_config(root), dense_optimizer=opt) as ck:
        for step in range(1, 5):
            train(dmp, specs, opt, 2, gen)
            assert ck.save(step).wait().kind == ("baseline" if step == 1 else "delta")


def _restore_plan_b(rank, world_size, root, want_path):
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(_plan_specs(PLAN_B), seed=3)
    with Checkpointer(dmp, _residual_config(root), dense_optimizer=opt) as ck:
        assert ck.restore() == 4
    want = torch.load(want_path, weights_only=True)
    for (table, rows, cols), got in _weights(dmp).items():
        torch.testing.assert_close(got, want[table][rows[0]:rows[1], cols[0]:cols[1]], rtol=0, atol=1e-6,
                                   msg=lambda m: f"{table} {rows} {cols}: {m}")


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_residual_chain_of_two_ranks_restores_onto_one_rank_and_another_plan(tmp_path):
    """Every sharding type, 2 ranks -> 1 under another plan, against the export (which adds the chain up
    over whole tables, apart from the restore's claims per shard)."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.export import export_state_dict

    root = str(tmp_path / "ck")
    run_ranks(_write_plan_a, world_size=2, timeout=200, args=(root,))
    storage = Storage(root)
    try:
        state = export_state_dict(storage)
    finally:
        storage.close()
    want = {t: next(v for k, v in state.items() if k.endswith(f".{t}.weight")) for t in [f"t{i}" for i in range(5)]}
    torch.save(want, tmp_path / "want.pt")
    run_ranks(_restore_plan_b, world_size=1, timeout=200, args=(root, str(tmp_path / "want.pt")))


# ---------------------------------------------------------------------- TorchRec's own models

def _torchrec_save_worker(rank, world_size, root, model, ref_path):
    """TorchRec's TestSparseNN (shared, weighted, mixed-dim tables) or TestMixedEmbeddingSparseArch (EC) on
    2 ranks under plan A, a residual chain; rank 0 follows every entry with the closed-loop reference."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, "A")
    expected: dict[str, torch.Tensor] = {}
    with Checkpointer(dmp, _default_config(root), dense_optimizer=opt) as ck:
        for step in range(1, 5):
            M.train_step(dmp, opt, M.make_batch(model, seed=100 * step + rank))
            info = ck.save(step).wait()
            live = {t: w.float() for t, (w, _, _) in M.full_tables(dmp, model).items()}
            if rank != 0:
                continue
            for t, w in live.items():
                if dmp.dirty_tracker.is_data_parallel(t):
                    expected[t] = w.clone()  # replicated tables are stored whole in float32
            for (t, rows, cols), (ids, residual) in _written(root, info.id).items():
                assert not residual or step > 1, (step, t)
                r = torch.arange(rows[1] - rows[0]) if ids is None else ids
                r = r + rows[0]
                piece = live[t][r, cols[0]:cols[1]]
                if step == 1:
                    whole = expected.setdefault(t, torch.full_like(live[t], float("nan")))
                    whole[r, cols[0]:cols[1]] = _roundtrip(piece)
                else:
                    before = expected[t][r, cols[0]:cols[1]]
                    expected[t][r, cols[0]:cols[1]] = _coded(before, piece)
    if rank == 0:
        torch.save(expected, ref_path)


def _torchrec_restore_worker(rank, world_size, root, model, ref_path):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, "B", seed=5)
    with Checkpointer(dmp, _default_config(root), dense_optimizer=opt) as ck:
        assert ck.restore() == 4
    want = torch.load(ref_path, weights_only=True)
    for t, (w, _, _) in M.full_tables(dmp, model).items():
        torch.testing.assert_close(w.float(), want[t], rtol=0, atol=1e-6, msg=lambda m: f"{model} {t}: {m}")


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["sparse_nn", pytest.param("mixed", marks=pytest.mark.long)])
def test_a_residual_chain_of_torchrecs_models_restores_onto_other_plans(tmp_path, model):
    """TorchRec's TestSparseNN (shared tables, weighted features) and an EBC + EC model, on the default config:
    it codes residuals (every delta entry is residual) and restores onto other plans as the closed loop says."""
    root, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    run_ranks(_torchrec_save_worker, world_size=2, timeout=150, args=(root, model, ref))
    run_ranks(_torchrec_restore_worker, world_size=1, timeout=100, args=(root, model, ref))  # 2 ranks -> 1, plan B
    run_ranks(_torchrec_restore_worker, world_size=2, timeout=100, args=(root, model, ref))  # plan B on 2 ranks


# ---------------------------------------------------------------------- CPR partial recovery

def _recover_worker(rank, world_size, root):
    """Rank 1 fails and recovers its shards from a residual chain while rank 0 keeps its live rows. Rank 0's
    reconstruction must stay the chain's (not its live rows), rank 1's becomes what it restored: the next
    residual delta of each then restores as the closed-loop reference says."""
    from cnr_torchrec import Checkpointer

    specs = _plan_specs(PLAN_A[:4])  # data_parallel tables are replicated, not recovered from the chain
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(20 + rank)
    mine = lambda written: {k: v for k, v in written.items() if k in expected}  # noqa: E731
    with Checkpointer(dmp, _residual_config(root), dense_optimizer=opt) as ck:
        for step in (1, 2, 3):
            train(dmp, specs, opt, 2, gen)
            info = ck.save(step).wait()
            live = _weights(dmp)
            if step == 1:
                expected = {key: _roundtrip(w) for key, w in live.items()}
            else:
                _follow(expected, mine(_written(root, info.id)), live)
        train(dmp, specs, opt, 2, gen)  # progress after checkpoint 3: the survivor keeps it
        live = _weights(dmp)
        if rank == 1:
            with torch.no_grad():
                for t in dmp.dirty_tracker.tables():
                    for k, s in dmp.dirty_tracker.shards(t):
                        k.tbe.split_embedding_weights()[s.local_index].uniform_(-1, 1)
            dmp.dirty_tracker.reset(baseline=True)
        assert ck.recover([1]).step == 3
        got = _weights(dmp)
        if rank == 1:
            _assert_restored(got, expected)
        else:
            assert all(torch.equal(got[k], live[k]) for k in live)
        train(dmp, specs, opt, 1, gen)
        info = ck.save(4).wait()
        assert info.kind == "delta"
        before = {k: (got[k] if rank == 1 else expected[k]).clone() for k in expected}
        _follow(expected, mine(_written(root, info.id)), _weights(dmp), before)
    _assert_fresh_restore(root, specs, 4, 4, expected)


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_partial_recovery_of_a_residual_chain_keeps_the_survivors_reconstruction(tmp_path):
    run_ranks(_recover_worker, world_size=2, timeout=200, args=(str(tmp_path / "ck"),))


# ---------------------------------------------------------------------- host memory


def _table_bytes(specs):
    """float32 bytes of every table, from TorchRec's own configs of the unsharded model."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    from examples.toy import ToyModel

    out = 0
    for module in ToyModel(specs).modules():
        if isinstance(module, EmbeddingBagCollection):
            out += sum(c.num_embeddings * c.embedding_dim * 4 for c in module.embedding_bag_configs())
        elif isinstance(module, EmbeddingCollection):
            out += sum(c.num_embeddings * c.embedding_dim * 4 for c in module.embedding_configs())
    return out


def _rowwise_state_bytes(specs):
    """Row-wise Adagrad's float32 sum per row of every fused (not data_parallel) table."""
    return sum(s.rows * 4 for s in specs if s.sharding != "data_parallel")


def _budget(table_bytes, rowwise, fold=0, image=True):
    """What residual coding asks of a host: the float32 copy (with the memory tier on, the default, its image:
    the optimizer states beside it), a baseline's copy of the weights and fused optimizer state to host
    memory, and a fold's working set, with 10% headroom."""
    return round((_copy(table_bytes, rowwise, image) + table_bytes + rowwise + fold) * 1.1)


def _copy(table_bytes, rowwise, image=True):
    """The host memory residual coding keeps: the float32 copy, and in the memory tier's image the states too."""
    return table_bytes + (rowwise if image else 0)


def test_the_reconstruction_is_logged_shown_by_inspect_and_refused_where_it_does_not_fit(
        group, tmp_path, caplog, monkeypatch, capsys):
    from examples.toy import TableSpec

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt import host_memory
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.summary import summarize
    from cnr_torchrec.cli import main

    specs = [*_specs(), TableSpec("t2", 16, 4, "data_parallel")]
    dmp, opt = build_dmp(specs)
    tables = _table_bytes(specs)  # one rank holds every shard, and a data_parallel table once
    want = _budget(tables, _rowwise_state_bytes(specs))
    copy = _copy(tables, _rowwise_state_bytes(specs))
    config = dataclasses.replace(_residual_config(str(tmp_path / "root")), compaction=None)  # no fold to budget

    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: want - 1)
    with pytest.raises(ConfigError, match=r"quantization.residual keeps .* 1 rank\(s\) on host .* Set quantization"):
        Checkpointer(dmp, config, dense_optimizer=opt)
    assert not (tmp_path / "root").exists()  # refused before anything was opened

    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: want)
    with caplog.at_level("INFO", logger="cnr_torchrec.ckpt.residual_choice"):
        ck = Checkpointer(dmp, config, dense_optimizer=opt)
    assert f"{copy / 1e6:,.1f} MB of host memory" in caplog.text and f"{want / 1e6:,.1f} MB with headroom" in caplog.text
    gen = torch.Generator().manual_seed(0)
    with ck:
        for step in (1, 2):
            train(dmp, specs, opt, 1, gen)
            ck.save(step).wait()
    storage = Storage(str(tmp_path / "root"))
    try:
        summary = summarize(storage)
    finally:
        storage.close()
    assert [r["residual"] for r in summary["checkpoints"]] == [False, True]
    assert summary["reconstruction_nbytes"] == tables
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "root")]) == 0
    assert "residual chain: a job that resumes it keeps a float32 copy of its shards" in capsys.readouterr().out

    from cnr_torchrec import load_config

    plain = str(tmp_path / "plain")  # a plain chain keeps no copy: nothing to show
    with Checkpointer(dmp, load_config({"root": plain, "quantization": {"residual": False}}), dense_optimizer=opt) as ck:
        for step in (3, 4):
            train(dmp, specs, opt, 1, gen)
            ck.save(step).wait()
    storage = Storage(plain)
    try:
        summary = summarize(storage)
    finally:
        storage.close()
    assert [r["residual"] for r in summary["checkpoints"]] == [False, False]
    assert summary["reconstruction_nbytes"] == 0


def test_a_fold_needs_its_largest_shard_on_top_and_is_refused_without_it(group, tmp_path, monkeypatch):
    """With compaction, the host must also hold the largest shard's float32 sums and row-wise Adagrad state
    (expanded per value) and two byte masks while a fold runs: t0's 64 x 8 values, 10 bytes each; and every
    shard's folded rows at 8 bits, a byte a value and 8 bytes a row: 64 x (8 + 8) + 32 x (4 + 8)."""
    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt import host_memory

    specs = _specs()
    dmp, opt = build_dmp(specs)
    want = _budget(_table_bytes(specs), _rowwise_state_bytes(specs), 64 * 8 * (4 + 4 + 2) + 64 * (8 + 8) + 32 * (4 + 8))
    config = load_config({"root": str(tmp_path / "root"), "compaction": {"max_chain": 3},
                          "quantization": {"method": "adaptive", "bits": 4, "residual": True}})
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: want - 1)
    with pytest.raises(ConfigError, match=r"while compaction folds the chain its largest shard.* 8-bit folded rows"):
        Checkpointer(dmp, config, dense_optimizer=opt)
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: want)
    Checkpointer(dmp, config, dense_optimizer=opt).close()


def _two_ranks_refused(rank, world_size, root):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt import host_memory

    dmp, opt = build_dmp(_specs())
    tracker = dmp.dirty_tracker  # what this rank asks of its host (the formula is pinned by the tests above)
    mine = round((host_memory.reconstruction_bytes(tracker) + host_memory.staging_bytes(tracker)) * 1.1)
    both = torch.tensor([mine])
    torch.distributed.all_reduce(both)
    # Each rank alone fits; the two together do not: the host's sum decides, on both ranks.
    host_memory.host_available_bytes = lambda: int(both) - 1
    with pytest.raises(ConfigError, match=r"for the 2 rank\(s\) on host"):
        Checkpointer(dmp, dataclasses.replace(_residual_config(root), compaction=None), dense_optimizer=opt)
    assert mine < int(both) - 1


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_ranks_on_one_host_add_up_and_every_rank_is_refused(tmp_path):
    run_ranks(_two_ranks_refused, world_size=2, timeout=100, args=(str(tmp_path / "root"),))
