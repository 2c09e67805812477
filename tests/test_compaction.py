"""Background compaction of a consecutive chain, retention, and commits whose cost does not grow.

References no one here wrote: the live TorchRec model at save time (fp32 restores must equal
it), and, for quantized rows, the restore of the very chain a compaction folded (the
compacted baseline keeps every row's stored bytes, so the two restores must be identical).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from _dist import run_ranks
from _toy import build_dmp, local_state, train

PLAN_A = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
PLAN_B = ("row_wise", "column_wise", "table_row_wise", "data_parallel", "table_wise")
ROWS, DIM = 300, 8


def _build(plan=PLAN_A, seed=0):
    from examples.toy import TableSpec

    specs = [TableSpec(f"t{i}", ROWS, DIM, st, "ebc") for i, st in enumerate(plan)]
    dmp, opt = build_dmp(specs, seed=seed)
    return dmp, specs, opt


def _config(root, method="none", bits=None, params=None, state_dtype="float32", **kw):
    from cnr_torchrec import load_config

    # Plain coding: these chains merge losslessly (residual chains fold: test_residual.py).
    quantization = {"method": method, "bits": bits, "params": params or {}, "state_dtype": state_dtype,
                    "residual": False}
    return load_config({"root": root, "policy": "consecutive", "quantization": quantization, **kw})


def _bodies(root):
    """Every committed checkpoint's manifest as one JSON body, its ranks' reports under ``ranks``."""
    from _format_checks import combined_body

    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids

    storage = Storage(root)
    try:
        return {i: combined_body(storage, i) for i in committed_ids(storage)}
    finally:
        storage.close()


def _run_job(root, specs, dmp, opt, ckpt, saves, gen, step=0):
    """Trains and saves ``saves`` times, waiting for each commit and each rank's compaction part, so that
    every compaction folds at the save after it finished (deterministic)."""
    kinds = []
    for _ in range(saves):
        train(dmp, specs, opt, 2, gen)
        step += 2
        kinds.append(ckpt.save(step).wait().kind)
        ckpt.wait(compaction=True)
    return kinds, step


def _restored(root, plan=PLAN_A, step=None, **kw):
    from cnr_torchrec import Checkpointer

    dmp, _, opt = _build(plan, seed=7)
    ck = Checkpointer(dmp, _config(root, **kw), dense_optimizer=opt)
    got = ck.restore(step)
    ck.close()
    return got, local_state(dmp)


def _assert_equal(got, want, what):
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad[:4]} differ"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method,bits,extra", [
    ("none", None, {}), ("fp16", None, {}), ("bf16", None, {}), ("uniform_sym", 8, {}),
    ("uniform_asym", 2, {"params": {"bias_dtype": "float16"}, "state_dtype": "bfloat16"}),
    ("kmeans", 3, {}), ("adaptive", 4, {}),
])
def test_a_chain_is_compacted_in_the_background_and_restores_exactly(group, tmp_path, method, bits, extra):
    from cnr_torchrec import Checkpointer

    root = str(tmp_path / "root")
    dmp, specs, opt = _build()
    cfg = dict(method=method, bits=bits, compaction={"max_chain": 3}, keep={"chains": 20}, **extra)
    ckpt = Checkpointer(dmp, _config(root, **cfg), dense_optimizer=opt)
    kinds, step = _run_job(root, specs, dmp, opt, ckpt, 12, torch.Generator().manual_seed(1))
    live = local_state(dmp)
    ckpt.close()

    # The trainers wrote one baseline, then deltas only; compactions wrote the other baselines.
    assert kinds == ["baseline"] + ["delta"] * 11
    bodies = _bodies(root)
    compacted = {i: b for i, b in bodies.items() if b.get("equals") is not None}
    assert len(compacted) >= 2, sorted(bodies)
    assert max(b["depth"] for b in bodies.values()) <= 4  # the chain stays bounded: 3 deltas, then one on top
    newest = max(bodies.values(), key=lambda b: (b["step"], b["id"]))
    assert newest["kind"] == "delta" and bodies[newest["base"]].get("equals") is not None

    got_step, restored = _restored(root, **cfg)
    assert got_step == step
    if method == "none":
        _assert_equal(restored, live, "restore of the newest checkpoint vs the live model")

    # Lossless: each compacted baseline restores exactly what the chain it folded restores.
    for c, body in compacted.items():
        tip = bodies[body["equals"]]
        without = str(tmp_path / f"without-{c}")
        shutil.copytree(root, without)
        shutil.rmtree(os.path.join(without, f"ckpt-{c:08d}"))
        os.remove(os.path.join(without, "index.json"))
        from_compacted = _restored(root, step=tip["step"], **cfg)
        from_chain = _restored(without, step=tip["step"], **cfg)
        assert from_compacted[0] == from_chain[0] == tip["step"]
        _assert_equal(from_compacted[1], from_chain[1], f"compacted {c} vs chain {body['compacted_from']}")


@pytest.mark.timeout(120)
def test_retention_collects_the_folded_chain_and_every_kept_checkpoint_restores(group, tmp_path):
    from cnr_torchrec import Checkpointer

    root = str(tmp_path / "root")
    dmp, specs, opt = _build()
    cfg = dict(compaction={"max_chain": 2}, keep={"checkpoints": 2})
    ckpt = Checkpointer(dmp, _config(root, **cfg), dense_optimizer=opt)
    states = {}
    step = 0
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        _, step = _run_job(root, specs, dmp, opt, ckpt, 1, gen, step)
        states[step] = local_state(dmp)
    ckpt.close()
    bodies = _bodies(root)
    # The newest two checkpoints and what they need: the last compacted baseline and the deltas on it (and,
    # while the newest compaction has not been folded, the chain it reads). Every earlier chain is gone.
    assert len(bodies) <= 5 and min(bodies) >= 7, sorted(bodies)
    assert sorted(os.listdir(root)) == sorted([f"ckpt-{i:08d}" for i in bodies] + ["index.json"])
    for b in bodies.values():
        got, restored = _restored(root, step=b["step"], **cfg)
        _assert_equal(restored, states[b["step"]], f"kept checkpoint {b['id']} (step {b['step']})")


@pytest.mark.timeout(120)
def test_a_failed_compaction_leaves_the_chain_going_on(group, tmp_path, monkeypatch):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.compact import merge

    def broken(*args, **kwargs):
        raise OSError("disk gone while merging")

    monkeypatch.setattr(merge, "merge_rank", broken)
    root = str(tmp_path / "root")
    dmp, specs, opt = _build()
    ckpt = Checkpointer(dmp, _config(root, compaction={"max_chain": 2}), dense_optimizer=opt)
    kinds, step = _run_job(root, specs, dmp, opt, ckpt, 7, torch.Generator().manual_seed(3))
    live = local_state(dmp)
    ckpt.close()
    assert kinds == ["baseline"] + ["delta"] * 6
    bodies = _bodies(root)
    assert not any(b.get("equals") is not None for b in bodies.values())
    assert sorted(os.listdir(root)) == sorted([f"ckpt-{i:08d}" for i in bodies] + ["index.json"])  # no leftovers
    got, restored = _restored(root)
    assert got == step
    _assert_equal(restored, live, "restore after failed compactions")


def _plan_change_worker(rank, world_size, root, method, bits):
    import torch.distributed as dist

    from cnr_torchrec import Checkpointer

    cfg = dict(method=method, bits=bits, compaction={"max_chain": 3}, keep={"chains": 20})
    dmp, specs, opt = _build(PLAN_A)
    ck = Checkpointer(dmp, _config(root, **cfg), dense_optimizer=opt)
    gen = torch.Generator().manual_seed(10 + rank)
    _, step = _run_job(root, specs, dmp, opt, ck, 2, gen)
    ck.close()
    # Another plan continues the same chain; the next compaction folds checkpoints of both plans.
    dmp, specs, opt = _build(PLAN_B, seed=5)
    ck = Checkpointer(dmp, _config(root, **cfg), dense_optimizer=opt)
    assert ck.restore() == step
    kinds, step = _run_job(root, specs, dmp, opt, ck, 5, gen, step)
    live = local_state(dmp)
    ck.close()
    dist.barrier()
    assert kinds == ["delta"] * 5
    bodies = _bodies(root)
    folded = [b for b in bodies.values() if b.get("equals") is not None and b["compacted_from"][0] == 0]
    assert folded, "no compaction folded the chain that spans both plans"
    if method == "none":
        got, restored = _restored(root, PLAN_B, **cfg)
        assert got == step
        _assert_equal(restored, live, f"rank {rank}: restore after compacting across a plan change")


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method,bits", [("none", None)])
def test_compaction_across_a_plan_change_on_two_ranks(tmp_path, method, bits):
    run_ranks(_plan_change_worker, world_size=2, timeout=280, args=(str(tmp_path / "root"), method, bits))


@pytest.mark.timeout(120)
def test_commit_cost_and_manifest_size_do_not_grow_with_the_chain(group, tmp_path, monkeypatch):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root = str(tmp_path / "root")
    dmp, specs, opt = _build()
    ckpt = Checkpointer(dmp, _config(root, compaction=None), dense_optimizer=opt)  # the chain grows
    reads: list[str] = []
    real_read = Storage.read

    def counting(self, path, *args, **kwargs):
        reads.append(path)
        return real_read(self, path, *args, **kwargs)

    monkeypatch.setattr(Storage, "read", counting)
    per_save = []
    gen = torch.Generator().manual_seed(4)
    for i in range(24):
        before = len(reads)
        train(dmp, specs, opt, 1, gen)
        ckpt.save(i + 1).wait()
        per_save.append(len(reads) - before)
    ckpt.close()
    # The first commit loads the catalog (every manifest once); later ones read nothing at all.
    assert per_save[2:] == [0] * 22, per_save
    sizes = [os.path.getsize(os.path.join(root, f"ckpt-{i:08d}", "manifest.json")) for i in (3, 23)]
    assert abs(sizes[1] - sizes[0]) < 0.02 * sizes[0], sizes  # depth 3 vs depth 23: the same fields


# ---- retention rules (the catalog) -------------------------------------------------------


def _catalog(spec):
    """A catalog from (id, step, kind, parent, base, nbytes[, equals]) rows (equals: a compaction's tip)."""
    from cnr_torchrec.ckpt.retention import Catalog, Entry

    return Catalog(Entry(*row[:6], 1, equals=row[6] if len(row) > 6 else None) for row in spec)


# A consecutive chain 0..4, a compaction 5 of chain 0..2 (step 30), and deltas 6, 7 hanging on it.
ROOT = [(0, 10, "baseline", None, 0, 100), (1, 20, "delta", 0, 0, 10), (2, 30, "delta", 1, 0, 10),
        (3, 40, "delta", 2, 0, 10), (4, 50, "delta", 3, 0, 10), (5, 30, "baseline", None, 5, 100, 2),
        (6, 60, "delta", 5, 5, 30), (7, 70, "delta", 6, 5, 10)]


@pytest.mark.parametrize("keep,want", [
    ({"checkpoints": 1}, {5, 6, 7}),
    ({"checkpoints": 2}, {5, 6, 7}),
    ({"checkpoints": 3}, {0, 1, 2, 3, 4, 5, 6, 7}),  # the third newest state, 4, needs the old chain
    ({"bytes": 140}, {5, 6, 7}),  # the newest is kept whatever it costs...
    ({"bytes": 300}, {0, 1, 2, 3, 4, 5, 6, 7}),  # ...and older ones while everything kept fits
    ({"bytes": 250}, {5, 6, 7}),
    ({"chains": 1}, {5, 6, 7}),
    ({"chains": 2}, {0, 1, 2, 3, 4, 5, 6, 7}),
    ({"checkpoints": 3, "bytes": 200}, {5, 6, 7}),  # both limits hold
])
def test_retention_keeps_the_newest_states_with_what_they_need(keep, want):
    from cnr_torchrec.ckpt.config import KeepConfig

    assert _catalog(ROOT).retained(KeepConfig(**keep)) == want


def test_retention_keeps_what_a_compaction_reads():
    from cnr_torchrec.ckpt.config import KeepConfig

    catalog = _catalog(ROOT[:5] + [(8, 80, "baseline", None, 8, 100)])  # a failed save restarted the chain
    assert catalog.retained(KeepConfig(checkpoints=1)) == {8}
    assert catalog.retained(KeepConfig(checkpoints=1), pinned=(0, 1, 2)) == {0, 1, 2, 8}


def _two_rank_start(rank, world_size, root):
    from cnr_torchrec import Checkpointer

    dmp, specs, opt = _build(PLAN_A)
    ck = Checkpointer(dmp, _config(root, compaction={"max_chain": 3}), dense_optimizer=opt)
    _run_job(root, specs, dmp, opt, ck, 2, torch.Generator().manual_seed(20 + rank))
    ck.close()


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_compaction_across_a_change_of_world_size(group, tmp_path):
    from cnr_torchrec import Checkpointer

    root = str(tmp_path / "root")
    run_ranks(_two_rank_start, world_size=2, timeout=200, args=(root,))
    # One rank, another plan, goes on with the chain the two ranks wrote; a compaction folds both.
    dmp, specs, opt = _build(PLAN_B, seed=3)
    ck = Checkpointer(dmp, _config(root, compaction={"max_chain": 3}, keep={"chains": 20}), dense_optimizer=opt)
    step = ck.restore(per_rank_state="drop")
    _, step = _run_job(root, specs, dmp, opt, ck, 4, torch.Generator().manual_seed(5), step)
    live = local_state(dmp)
    ck.close()
    bodies = _bodies(root)
    folded = [b for b in bodies.values() if b.get("equals") is not None and b["compacted_from"][0] == 0]
    assert folded and folded[0]["world_size"] == 1 and bodies[0]["world_size"] == 2  # 2 ranks' rows, 1 rank merged
    got, restored = _restored(root, PLAN_B, compaction={"max_chain": 3})
    assert got == step
    _assert_equal(restored, live, "restore after compacting across a change of world size")
