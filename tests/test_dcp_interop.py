"""DCP interop: ``cnr export --format dcp`` and ``cnr import-dcp``, against independent references.

* the trained model itself: whole tables gathered from every rank's shards (weights, and the row-wise
  Adagrad state as the column-width-weighted mean over column shards), dense parameters and the dense
  optimizer's state by parameter name;
* ``Checkpointer.restore`` of the same quantized chain onto the same (other) plan;
* torch's own ``dcp.load`` with its default planner, and ``dcp.save`` of a live DMP;
* synthetic DCP checkpoints written by ``dcp.save`` of plain tensors, for the refusals.

The models are TorchRec's ``TestSparseNN`` under plans "A" and "B" (``_torchrec_models``): every
table but one changes sharding type between them, column-wise included. Row-wise state of a table
saved in several column shards and loaded onto a shard spanning several of them is their mean, which
no shard of the trained model held: it is compared within float32 rounding. Everything else is
compared bit for bit.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

import _torchrec_models as tm
from _dist import run_ranks

MODEL = "sparse_nn"
SPLIT_IN_A = {t.name for t in tm.SPARSE_NN if t.plans["A"] == "column_wise"}  # row-wise state merged elsewhere


def _config(root, method, bits, residual=False):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive",
                        "quantization": {"method": method, "bits": bits, "residual": residual}})


CHAINS = (("fp32", "none", None, False), ("q4", "adaptive", 4, False), ("r4", "adaptive", 4, True))
"""The chains the fixture trains: fp32, adaptive 4-bit, and adaptive 4-bit residual (quantization.residual)."""


def _state_dict(dmp):
    """What the export holds, as a DMP exposes it (the layout of docs/dcp.md)."""
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def _reference(dmp, opt):
    """The trained model, whole: tables (weights, row-wise state, data_parallel), dense tensors, dense optimizer."""
    tables = {t: (w, m, dp) for t, (w, m, dp) in tm.full_tables(dmp, MODEL).items()}
    dense = {k: v for k, v in tm.local_state(dmp, opt).items() if isinstance(k, str)}
    return {"tables": tables, "dense": dense, "dense_opt": tm.dense_optimizer_state(dmp, opt)}


def _train_worker(rank, world_size, out):
    """2-rank chains of plan A (a baseline and two deltas): fp32, adaptive 4-bit and 4-bit residual; and
    dcp.save of the fp32 DMP itself, for the import."""
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.tools.dcp import dense_optimizer_state_dict

    for name, method, bits, residual in CHAINS:
        dmp, opt = tm.build_dmp(MODEL, "A")
        ckpt = Checkpointer(dmp, _config(os.path.join(out, name), method, bits, residual), dense_optimizer=opt)
        kinds = []
        for step in range(3):
            for i in range(2):
                tm.train_step(dmp, opt, tm.make_batch(MODEL, 1000 * step + 10 * i + rank))
            kinds.append(ckpt.save(step).wait().kind)
        ckpt.close()
        assert kinds == ["baseline", "delta", "delta"]
        if name != "fp32":
            continue
        ref = _reference(dmp, opt)
        if rank == 0:
            torch.save(ref, os.path.join(out, "ref.pt"))
        torch.save(tm.local_state(dmp, opt), os.path.join(out, f"local{rank}.pt"))
        dcp.save({**_state_dict(dmp), "dense_optim": dense_optimizer_state_dict(dmp, opt)},
                 checkpoint_id=os.path.join(out, "dmp.dcp"))


def _load(dmp, opt, path, **kw):
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec.ckpt.tools.dcp import DMPLoadPlanner, load_dense_optimizer

    sd = _state_dict(dmp)
    dcp.load(sd, checkpoint_id=path, **({"planner": DMPLoadPlanner()} | kw))
    load_dense_optimizer(path, dmp, opt)


def _assert_like_reference(dmp, opt, ref, what):
    """Whole tables, dense tensors and dense optimizer state equal the trained model's (module docstring)."""
    got = _reference(dmp, opt)
    for t, (w, m, dp) in got["tables"].items():
        assert torch.equal(w, ref["tables"][t][0]), (what, t, (w - ref["tables"][t][0]).abs().max())
        if dp:
            continue  # a data_parallel table's state is in the dense optimizer
        want = ref["tables"][t][1]  # zero for a table data_parallel in plan A: it had no fused state
        if t in SPLIT_IN_A:
            torch.testing.assert_close(m, want, rtol=1e-6, atol=0, msg=lambda s: f"{what} {t}: {s}")
        else:
            assert torch.equal(m, want), (what, t, (m - want).abs().max())
    tm.assert_same(got["dense"], ref["dense"], what)
    for name, state in got["dense_opt"].items():
        # Parameters dense under both plans keep their state; tables that became dense start fresh.
        tm.assert_same(state, ref["dense_opt"].get(name, {}), f"{what}: dense optimizer of {name}")


def _load_worker(rank, world_size, out):
    """Plan B, on 1 or 2 ranks: the fp32 export; on 2 ranks also the q4 export against the q4 chain's restore,
    the DMP's own DCP checkpoint, its import restored, and plan A through torch's default planner."""
    from cnr_torchrec import Checkpointer

    ref = torch.load(os.path.join(out, "ref.pt"), weights_only=False)
    dmp, opt = tm.build_dmp(MODEL, "B", seed=5)
    before = tm.full_tables(dmp, MODEL)
    assert not torch.equal(before["abc"][0], ref["tables"]["abc"][0])  # not vacuous
    _load(dmp, opt, os.path.join(out, "fp32.dcp"))
    _assert_like_reference(dmp, opt, ref, f"fp32 export on {world_size} rank(s)")
    if world_size == 1:
        return

    _assert_export_is_restore(out, "q4")
    _assert_export_is_restore(out, "r4")

    theirs, opt_t = tm.build_dmp(MODEL, "B", seed=10)  # the DMP's own dcp.save, through the same planner
    _load(theirs, opt_t, os.path.join(out, "dmp.dcp"))
    _assert_like_reference(theirs, opt_t, ref, "dcp.save(dmp.state_dict()) of plan A loaded onto plan B")

    imported, opt_i = tm.build_dmp(MODEL, "B", seed=8)
    ckpt = Checkpointer(imported, _config(os.path.join(out, "imported"), "none", None), dense_optimizer=opt_i)
    assert ckpt.restore() == 7  # the step given to cnr import-dcp
    ckpt.close()
    _assert_like_reference(imported, opt_i, ref, "import of dcp.save(dmp.state_dict()), restored")

    # Plan A as trained: torch's default planner loads it as it is, every shard bit for bit.
    same, opt_s = tm.build_dmp(MODEL, "A", seed=9)
    _load(same, opt_s, os.path.join(out, "fp32.dcp"), planner=None)
    tm.assert_same(tm.local_state(same, opt_s), torch.load(os.path.join(out, f"local{rank}.pt"), weights_only=False),
                   "fp32 export, plan A, default planner")
    _assert_layout_is_dmps(same, os.path.join(out, "fp32.dcp"))


def _assert_export_is_restore(out, name):
    """Chain ``name`` exported to DCP and loaded onto plan B equals the chain restored onto plan B."""
    from cnr_torchrec import Checkpointer

    _, method, bits, residual = next(c for c in CHAINS if c[0] == name)
    restored, opt_r = tm.build_dmp(MODEL, "B", seed=6)
    with Checkpointer(restored, _config(os.path.join(out, name), method, bits, residual), dense_optimizer=opt_r) as ck:
        ck.restore()
    loaded, opt_l = tm.build_dmp(MODEL, "B", seed=7)
    _load(loaded, opt_l, os.path.join(out, f"{name}.dcp"))
    want, got = tm.local_state(restored, opt_r), tm.local_state(loaded, opt_l)
    assert want.keys() == got.keys()
    for key, value in want.items():
        if isinstance(key, tuple) and key[0] in SPLIT_IN_A and key[2] == 0:  # row-wise state, merged
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=0)
        elif residual and isinstance(key, tuple) and key[2] == "w":
            # A residual row is a sum of decoded rows: the restore adds them newest first, the export
            # oldest first, so the float32 sums may differ in their last bit.
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")
        else:
            assert got[key] == value if not torch.is_tensor(value) else torch.equal(got[key], value), (name, key)


def _assert_layout_is_dmps(dmp, path):
    """The export's keys, sizes and dtypes are those a DMP of the checkpoint's plan saves."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    md = FileSystemReader(path).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(_state_dict(dmp))
    mine = {k: (tuple(v.size()), v.dtype) for k, v in flat.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # a rank's fused optimizer lists only the tables it holds shards of
    dmp_keys = {k: v for part in every for k, v in part.items()}
    assert {k: (tuple(md[k].size), md[k].properties.dtype) for k in dmp_keys if k in md} == dmp_keys
    assert {k for k in md if k.startswith(("model.", "optim."))} == set(dmp_keys)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The chains, the DMP's own DCP checkpoint, and the exports and import of them (through the CLI)."""
    from cnr_torchrec.cli import main

    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest
    from cnr_torchrec.ckpt.format.storage import Storage

    out = str(tmp_path_factory.mktemp("dcp"))
    run_ranks(_train_worker, world_size=2, timeout=150, args=(out,))
    storage = Storage(os.path.join(out, "r4"))
    try:  # the residual chain's deltas hold residual rows: its export adds them up
        assert any(e.residual for _, _, e in load_manifest(storage, committed_ids(storage)[-1]).entries())
    finally:
        storage.close()
    for name, *_ in CHAINS:
        assert main(["export", "--format", "dcp", os.path.join(out, name), "--out",
                     os.path.join(out, f"{name}.dcp")]) == 0
    assert main(["import-dcp", os.path.join(out, "dmp.dcp"), os.path.join(out, "imported"), "--step", "7"]) == 0
    return out


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_export_loads_into_another_plan_and_world_size_and_import_restores(trained):
    run_ranks(_load_worker, world_size=1, timeout=120, args=(trained,))
    run_ranks(_load_worker, world_size=2, timeout=150, args=(trained,))


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_export_streams_one_table_at_a_time_and_import_verifies(trained, tmp_path):
    from cnr_torchrec.ckpt.tools.dcp import export_dcp
    from cnr_torchrec.ckpt.tools.offline import load_chain
    from cnr_torchrec.ckpt.tools.root import open_storage
    from cnr_torchrec.ckpt.tools.verify import verify_root

    storage = open_storage(os.path.join(trained, "fp32"))
    try:
        summary = export_dcp(storage, str(tmp_path / "again"))
        tip = load_chain(storage, summary["id"])[-1]
    finally:
        storage.close()
    assert summary["tables_decoded"] == len(tip.tables) == len(tm.SPARSE_NN)
    assert summary["step"] == 2 and sorted(os.listdir(tmp_path)) == ["again"]
    assert verify_root(os.path.join(trained, "imported")) == []


# ---------------------------------------------------------------------- one process: round trip and refusals


def _synthetic(path, *, weight=None, momentum=None, drop=()):
    """A DCP checkpoint of the layout, written by dcp.save of plain tensors: table t0 with row-wise state, t1
    without (data_parallel), two dense parameters, and Adam's state of one of them; ``drop``: model keys left out."""
    import warnings

    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    model = {"ebc.embedding_bags.t0.weight": torch.randn(10, 4, generator=g) if weight is None else weight,
             "ebc.embedding_bags.t1.weight": torch.randn(12, 4, generator=g),
             "dense.weight": torch.randn(1, 8, generator=g), "dense.bias": torch.zeros(1)}
    state = {"model": {k: v for k, v in model.items() if k not in drop},
             "optim": {"state": {"ebc.embedding_bags.t0.weight": {
                 "t0.momentum1": torch.rand(10, generator=g) if momentum is None else momentum}}},
             "dense_optim": {"state": {"dense.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(1, 8),
                                                        "exp_avg_sq": torch.rand(1, 8)}},
                             "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                               "amsgrad": False, "params": ["dense.weight", "dense.bias"]}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return state


def _assert_tree_equal(got, want, where=""):
    if torch.is_tensor(want):
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for k in want:
            _assert_tree_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_tree_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def _zeros_like(tree):
    if torch.is_tensor(tree):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_zeros_like(v) for v in tree]
    return None


def _storage(root):
    from cnr_torchrec.ckpt.tools.root import open_storage

    os.makedirs(root, exist_ok=True)
    return open_storage(root)


def test_import_then_export_gives_back_the_dcp_checkpoint(tmp_path, capsys, monkeypatch):
    """dcp.save -> cnr import-dcp -> cnr verify -> cnr export --format dcp -> dcp.load: the same state, and
    load_dense_optimizer gives a torch optimizer the saved state by parameter name. The import reads one table
    at a time."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from cnr_torchrec.cli import main
    from cnr_torchrec.ckpt.tools import dcp as interop

    src, root, out = str(tmp_path / "src"), str(tmp_path / "root"), str(tmp_path / "out")
    state = _synthetic(src)
    from cnr_torchrec.ckpt.tools.dcp import importer

    reads, real_read = [], importer._read
    monkeypatch.setattr(importer, "_read", lambda path, wanted: reads.append(sorted(wanted)) or real_read(path, wanted))
    assert main(["import-dcp", src, root, "--step", "5"]) == 0
    tables = [[k for k in keys if k.startswith("model.ebc.")] for keys in reads]  # table weights per read
    assert sorted(map(len, tables))[-1] == 1 and sum(map(len, tables)) == 2  # t0 (and its state), then t1
    assert "as baseline 0 (step 5)" in capsys.readouterr().out
    assert main(["verify", root]) == 0
    assert main(["export", "--format", "dcp", root, "--out", out]) == 0
    back = _zeros_like(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=out, no_dist=True)
    _assert_tree_equal(back, state)

    model = torch.nn.Module()
    model.dense = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    interop.load_dense_optimizer(out, model, opt)
    saved = state["dense_optim"]["state"]["dense.weight"]
    _assert_tree_equal(opt.state[model.dense.weight], saved)
    assert model.dense.bias not in opt.state and opt.param_groups[0]["lr"] == 0.01


def test_import_refuses_what_it_cannot_import(tmp_path):
    from cnr_torchrec.ckpt.format.commits import committed_ids
    from cnr_torchrec.ckpt.tools.dcp import import_dcp
    from cnr_torchrec.errors import (CheckpointNotFoundError, ConfigError, IncompatibleCheckpointError,
                                     UnsafeCheckpointError)

    storage = _storage(str(tmp_path / "root"))
    cases = {
        "bf16": (dict(weight=torch.randn(10, 4).bfloat16()), IncompatibleCheckpointError, "float32"),
        "lacks": (dict(drop=["ebc.embedding_bags.t0.weight"]), IncompatibleCheckpointError, "lacks those tables"),
        "rows": (dict(momentum=torch.rand(7)), IncompatibleCheckpointError, r"\[k \* 10\]"),
        "cw": (dict(momentum=torch.rand(20)), IncompatibleCheckpointError, "column-wise layouts"),
    }
    for name, (kw, error, match) in cases.items():
        _synthetic(str(tmp_path / name), **kw)
        with pytest.raises(error, match=match):
            import_dcp(str(tmp_path / name), storage)
        assert committed_ids(storage) == [] and os.listdir(tmp_path / "root") == [], name  # nothing left
    with pytest.raises(CheckpointNotFoundError, match="no .metadata"):
        import_dcp(str(tmp_path), storage)
    os.makedirs(tmp_path / "evil")
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(eval))
    with pytest.raises(UnsafeCheckpointError, match="builtins.eval"):
        import_dcp(str(tmp_path / "evil"), storage)

    _synthetic(str(tmp_path / "good"))
    assert import_dcp(str(tmp_path / "good"), storage).id == 0
    with pytest.raises(ConfigError, match="--append"):
        import_dcp(str(tmp_path / "good"), storage)
    _synthetic(str(tmp_path / "wider"), weight=torch.randn(10, 8), momentum=torch.rand(10))
    with pytest.raises(IncompatibleCheckpointError, match=r"'t0' is \[10, 8\] there and \[10, 4\]"):
        import_dcp(str(tmp_path / "wider"), storage, append=True)
    assert import_dcp(str(tmp_path / "good"), storage, append=True, step=9).id == 1
    assert committed_ids(storage) == [0, 1]
    storage.close()


def test_a_failed_import_commits_nothing(tmp_path, monkeypatch):
    from cnr_torchrec.ckpt.format import storage as storage_mod
    from cnr_torchrec.ckpt.format.commits import committed_ids
    from cnr_torchrec.ckpt.tools.dcp import import_dcp

    _synthetic(str(tmp_path / "src"))
    storage = _storage(str(tmp_path / "root"))

    def fail(self, path, data):
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(storage_mod.Storage, "write_atomic", fail)  # the commit itself fails
    with pytest.raises(OSError, match="No space left"):
        import_dcp(str(tmp_path / "src"), storage)
    assert committed_ids(storage) == [] and os.listdir(tmp_path / "root") == []
    storage.close()


def test_cli_refusals_are_one_line_and_exit_2(tmp_path, capsys):
    from cnr_torchrec.cli import main

    src, root = str(tmp_path / "src"), str(tmp_path / "root")
    _synthetic(src)
    assert main(["import-dcp", src, root]) == 0
    assert main(["export", "--format", "dcp", root, "--out", src]) == 2  # never overwrites
    assert main(["import-dcp", src, root]) == 2
    assert main(["export", "--format", "dcp", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert main(["import-dcp", str(tmp_path / "empty"), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and "Traceback" not in "".join(err), err
    assert "exists; give --out a new directory" in err[0] and "pass --append" in err[1]
    assert "does not exist" in err[2] and not (tmp_path / "x").exists()
    assert "no .metadata" in err[3] and not (tmp_path / "new").exists()  # a failed import leaves no new root


def _toy_import_worker(rank, world_size, tmp):
    """The toy model has a non-persistent buffer, which dmp.state_dict() (and so DCP) leaves out."""
    import torch.distributed.checkpoint as dcp

    from _toy import build_dmp, local_state, train

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.tools.dcp import import_dcp
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 40, 8, "row_wise"), TableSpec("t1", 24, 4, "table_wise")]
    dmp, opt = build_dmp(specs)
    train(dmp, specs, opt, 3, torch.Generator().manual_seed(0))
    assert not any("_unused" in k for k in dmp.state_dict())
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=f"{tmp}/dcp")
    from cnr_torchrec.ckpt.format.storage import Storage

    storage = Storage(f"{tmp}/root")
    try:
        import_dcp(f"{tmp}/dcp", storage)
    finally:
        storage.close()
    want = local_state(dmp)
    fresh, _ = build_dmp(specs, seed=1)
    fresh.module._unused.fill_(7.0)
    with Checkpointer(fresh, load_config({"root": f"{tmp}/root"})) as ck:
        assert ck.restore() == 0
    got = local_state(fresh)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert float(fresh.module._unused) == 7.0  # not in the import: left as it was


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_an_import_restores_into_a_model_with_non_persistent_buffers(tmp_path):
    run_ranks(_toy_import_worker, world_size=1, timeout=100, args=(str(tmp_path),))
