"""DCP interop: ``cnr export --format dcp`` and ``cnr import-dcp``, against independent references.

* the trained model itself: whole tables gathered from every rank's shards (weights, and the row-wise
  Adagrad state as the column-width-weighted mean over column shards), dense parameters and the dense
  optimizer's state by parameter name;
* ``Checkpointer.restore`` of the same quantized chain onto the same (other) plan;
* torch's own ``dcp.load`` with its default planner, and ``dcp.save`` of a live DMP;
* synthetic DCP checkpoints written by ``dcp.save`` of plain tensors, in both layouts (the model's keys at the
  top level, and nested under ``model`` as earlier versions wrote them), for the round trip and the refusals.

The code blocks of docs/dcp.md that save and load a DMP are run as they stand (``_doc_block``).

The models are TorchRec's ``TestSparseNN`` under plans "A" and "B" (``_torchrec_models``): every
table but one changes sharding type between them, column-wise included. Row-wise state of a table
saved in several column shards and loaded onto a shard spanning several of them is their mean, which
no shard of the trained model held: it is compared within float32 rounding. Everything else is
compared bit for bit.
"""

from __future__ import annotations

import os
import pickle
import re

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
    return {**dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def _doc_block(marker, **names):
    """Runs the python block of docs/dcp.md that holds ``marker``, with ``names`` defined: the docs' own code."""
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "dcp.md")) as f:
        found = [b for b in re.findall(r"```python\n(.*?)```", f.read(), re.S) if marker in b]
    assert len(found) == 1, (marker, len(found))
    exec(compile(found[0], f"docs/dcp.md ({marker})", "exec"), dict(names))


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
        _doc_block("dcp.save(", dmp=dmp, dense_optimizer=opt, step=7, DCP_DIR=os.path.join(out, "dmp.dcp"))
        dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict(),  # as the earlier docs did
                  "dense_optim": dense_optimizer_state_dict(dmp, opt)}, checkpoint_id=os.path.join(out, "nested.dcp"))


def _load(dmp, opt, path, default_planner=False):
    """The docs' load of the model and both optimizers (DMPLoadPlanner), or the same with DCP's default planner."""
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec.ckpt.tools.dcp import load_dense_optimizer

    if not default_planner:
        return _doc_block("load_dense_optimizer(", dmp=dmp, dense_optimizer=opt, OUT=path)
    dcp.load(_state_dict(dmp), checkpoint_id=path)
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
    the DMP's own DCP checkpoint (and in the older layout), its import restored, and plan A through torch's
    default planner."""
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.tools.dcp import DMPLoadPlanner, load_dense_optimizer

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

    nested, opt_n = tm.build_dmp(MODEL, "B", seed=11)  # the older layout, loaded as the earlier docs did
    dcp.load({"model": nested.state_dict(), "optim": nested.fused_optimizer.state_dict()},
             checkpoint_id=os.path.join(out, "nested.dcp"), planner=DMPLoadPlanner())
    load_dense_optimizer(os.path.join(out, "nested.dcp"), nested, opt_n)
    _assert_like_reference(nested, opt_n, ref, "dcp.save({'model': dmp.state_dict(), ...}) onto plan B")

    imported, opt_i = tm.build_dmp(MODEL, "B", seed=8)
    ckpt = Checkpointer(imported, _config(os.path.join(out, "imported"), "none", None), dense_optimizer=opt_i)
    assert ckpt.restore() == 7  # the step the DMP's checkpoint records (train_state.step)
    ckpt.close()
    _assert_like_reference(imported, opt_i, ref, "import of dcp.save(dmp.state_dict()), restored")

    # Plan A as trained: torch's default planner loads it as it is, every shard bit for bit.
    same, opt_s = tm.build_dmp(MODEL, "A", seed=9)
    _load(same, opt_s, os.path.join(out, "fp32.dcp"), default_planner=True)
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
    assert {k for k in md if not k.startswith(("dense_optim.", "train_state."))} == set(dmp_keys)
    assert "train_state.step" in md


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The chains, the DMP's own DCP checkpoint, and the exports and import of them (through the CLI)."""
    from cnr_torchrec.cli import main

    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

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
    assert main(["import-dcp", os.path.join(out, "dmp.dcp"), os.path.join(out, "imported")]) == 0
    return out


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_export_loads_into_another_plan_and_world_size_and_import_restores(trained):
    run_ranks(_load_worker, world_size=1, timeout=120, args=(trained,))
    run_ranks(_load_worker, world_size=2, timeout=150, args=(trained,))


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_export_streams_one_table_at_a_time_and_import_verifies(trained, tmp_path):
    from cnr_torchrec.ckpt.tools.checked_chain import load_chain
    from cnr_torchrec.ckpt.tools.dcp import export_dcp
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


def _model_only_worker(rank, world_size, out):
    """Plan B, on 1 or 2 ranks: ``dcp.load(dmp.state_dict(), ...)`` of the fp32 export of plan A, with DCP's default
    planner (the docs' line) and with DMPLoadPlanner, gives the trained model; the optimizers stay as they were."""
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec.ckpt.tools.dcp import DMPLoadPlanner

    ref, path = torch.load(os.path.join(out, "ref.pt"), weights_only=False), os.path.join(out, "fp32.dcp")
    loads = {"default planner": lambda dmp: _doc_block("dcp.load(dmp.state_dict(), checkpoint_id=OUT)", dmp=dmp,
                                                        OUT=path),
             "DMPLoadPlanner": lambda dmp: dcp.load(dmp.state_dict(), checkpoint_id=path, planner=DMPLoadPlanner())}
    for seed, (what, load) in enumerate(loads.items(), start=11):
        dmp, opt = tm.build_dmp(MODEL, "B", seed=seed)
        before = _reference(dmp, opt)
        assert not torch.equal(before["tables"]["abc"][0], ref["tables"]["abc"][0])  # not vacuous
        load(dmp)
        got = _reference(dmp, opt)
        for t, (w, m, _) in got["tables"].items():
            assert torch.equal(w, ref["tables"][t][0]), (what, t)
            assert torch.equal(m, before["tables"][t][1]), (what, t)  # the fused optimizer's state: untouched
        tm.assert_same(got["dense"], ref["dense"], f"{what}, model only, {world_size} rank(s)")
        assert got["dense_opt"].keys() == before["dense_opt"].keys(), what
        for name, state in got["dense_opt"].items():
            tm.assert_same(state, before["dense_opt"][name], f"{what}: dense optimizer of {name}")


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_model_only_load_takes_the_model_onto_another_plan(trained):
    run_ranks(_model_only_worker, world_size=1, timeout=100, args=(trained,))
    run_ranks(_model_only_worker, world_size=2, timeout=120, args=(trained,))


# ---------------------------------------------------------------------- one process: round trip and refusals

MC = "mc_ebc"  # a ManagedCollisionEmbeddingBagCollection's name in _synthetic(mc=True)


def _synthetic(path, *, weight=None, momentum=None, drop=(), more=None, mc=False, legacy=False, extra=None):
    """A DCP checkpoint of the layout, written by dcp.save of plain tensors: table t0 with row-wise state, t1
    without (data_parallel), two dense parameters, and Adam's state of one of them. ``drop``: model keys left out;
    ``more``: more model entries; ``mc``: t1 a managed-collision table, with its sort-zch buffers; ``legacy``: the
    model nested under ``model``, as earlier versions wrote it; ``extra``: more top-level entries."""
    import warnings

    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    t1 = f"{MC}._embedding_module.embedding_bags.t1.weight" if mc else "ebc.embedding_bags.t1.weight"
    model = {"ebc.embedding_bags.t0.weight": torch.randn(10, 4, generator=g) if weight is None else weight,
             t1: torch.randn(12, 4, generator=g),
             "dense.weight": torch.randn(1, 8, generator=g), "dense.bias": torch.zeros(1), **(more or {})}
    if mc:  # by sort position: raw ids ascending, the row each one holds, its count
        buffers = f"{MC}._managed_collision_collection._managed_collision_modules.t1"
        model |= {f"{buffers}._mch_sorted_raw_ids": torch.randperm(1000, generator=g)[:12].sort().values,
                  f"{buffers}._mch_remapped_ids_mapping": torch.randperm(12, generator=g),
                  f"{buffers}._mch_counts": torch.randint(1, 9, (12,), generator=g),
                  f"{buffers}._current_iter_tensor": torch.tensor([6]),
                  f"{buffers}._output_segments_tensor": torch.tensor([0, 12] + [-1] * 1023)}
    model = {k: v for k, v in model.items() if k not in drop}
    state = {**({"model": model} if legacy else model),
             "optim": {"state": {"ebc.embedding_bags.t0.weight": {
                 "t0.momentum1": torch.rand(10, generator=g) if momentum is None else momentum}}},
             "dense_optim": {"state": {"dense.weight": {"step": torch.tensor(3.0),
                                                        "exp_avg": torch.randn(1, 8, generator=g),
                                                        "exp_avg_sq": torch.rand(1, 8, generator=g)}},
                             "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                               "amsgrad": False, "params": ["dense.weight", "dense.bias"]}]},
             **(extra or {})}
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

    from cnr_torchrec.ckpt.tools import dcp as interop
    from cnr_torchrec.cli import main

    src, root, out = str(tmp_path / "src"), str(tmp_path / "root"), str(tmp_path / "out")
    state = _synthetic(src)
    from cnr_torchrec.ckpt.tools.dcp import importer

    reads, real_read = [], importer._read
    monkeypatch.setattr(importer, "_read", lambda path, wanted: reads.append(sorted(wanted)) or real_read(path, wanted))
    assert main(["import-dcp", src, root, "--step", "5"]) == 0
    tables = [[k for k in keys if k.startswith("ebc.")] for keys in reads]  # table weights per read
    assert sorted(map(len, tables))[-1] == 1 and sum(map(len, tables)) == 2  # t0 (and its state), then t1
    assert "as baseline 0 (step 5)" in capsys.readouterr().out
    assert main(["verify", root]) == 0
    assert main(["export", "--format", "dcp", root, "--out", out]) == 0
    back = {**_zeros_like(state), "train_state": {"step": 0}}  # as docs/dcp.md reads the step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=out, no_dist=True)
    _assert_tree_equal(back, {**state, "train_state": {"step": 5}})  # the step where torchtitan keeps it

    model = torch.nn.Module()
    model.dense = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    interop.load_dense_optimizer(out, model, opt)
    saved = state["dense_optim"]["state"]["dense.weight"]
    _assert_tree_equal(opt.state[model.dense.weight], saved)
    assert model.dense.bias not in opt.state and opt.param_groups[0]["lr"] == 0.01


def test_import_reads_the_older_nested_layout_too(tmp_path):
    """The model nested under ``model`` (what earlier versions exported, and the earlier docs' dcp.save) imports
    as the model's keys at the top level do, managed-collision buffers included: exported again, both give the
    top-level layout's values back."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from cnr_torchrec.ckpt.tools.dcp import export_dcp, import_dcp

    state = _synthetic(str(tmp_path / "top"), mc=True)
    assert _synthetic(str(tmp_path / "nested"), mc=True, legacy=True)["model"].keys() == (
        state.keys() - {"optim", "dense_optim"})
    for name in ("top", "nested"):
        storage = _storage(str(tmp_path / f"root-{name}"))
        try:
            assert import_dcp(str(tmp_path / name), storage, step=3).step == 3
            export_dcp(storage, str(tmp_path / f"out-{name}"))
        finally:
            storage.close()
        back = _zeros_like(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(back, checkpoint_id=str(tmp_path / f"out-{name}"), no_dist=True)
        _assert_tree_equal(back, state, name)


def test_import_records_the_step_the_checkpoint_holds(tmp_path):
    """A step saved as torchtitan saves it (``train_state``), at the top level or under ``trainer`` is the step
    of the import unless ``step`` is given; without one, the given ``step`` or 0. A step that is not an int >= 0 is
    refused."""
    from cnr_torchrec.ckpt.format.commits import load_manifest
    from cnr_torchrec.ckpt.tools.dcp import import_dcp
    from cnr_torchrec.errors import IncompatibleCheckpointError

    cases = {"none": ({}, False, 5), "train_state": ({"train_state": {"step": 12, "ntokens_seen": 300}}, False, 12),
             "top-level tensor": ({"step": torch.tensor(4)}, False, 4), "trainer": ({"trainer": {"step": 9}}, False, 9),
             "nested model": ({"train_state": {"step": 3}}, True, 3),
             "text": ({"train_state": {"step": "7"}}, False, None), "negative": ({"step": -1}, False, None),
             "fraction": ({"step": torch.tensor(1.5)}, False, None)}
    for name, (extra, legacy, want) in cases.items():
        _synthetic(str(tmp_path / name), extra=extra, legacy=legacy)
        storage = _storage(str(tmp_path / f"root-{name}"))
        try:
            if want is None:
                with pytest.raises(IncompatibleCheckpointError, match="not a training step"):
                    import_dcp(str(tmp_path / name), storage)
                continue
            assert import_dcp(str(tmp_path / name), storage).step == (0 if name == "none" else want), name
            assert sorted(load_manifest(storage, 0).ranks[0].dense) == ["dense.bias", "dense.weight"], name
            # A step given explicitly wins over the checkpoint's.
            assert import_dcp(str(tmp_path / name), storage, append=True, step=5).step == 5, name
        finally:
            storage.close()


def test_export_refuses_a_model_key_named_like_a_top_level_entry(tmp_path, capsys):
    """A module named ``optim`` (or a buffer named ``step``) would mix the model's keys with the named entries
    beside them: ``cnr export --format dcp`` refuses it (exit 2) and leaves nothing behind."""
    from cnr_torchrec.cli import main

    src, root, out = str(tmp_path / "src"), str(tmp_path / "root"), str(tmp_path / "out")
    _synthetic(src, legacy=True, more={"optim.scale": torch.ones(2), "step": torch.zeros(1)})
    assert main(["import-dcp", src, root]) == 0  # under "model", they are the model's
    capsys.readouterr()
    assert main(["export", "--format", "dcp", root, "--out", out]) == 2
    err = capsys.readouterr().err
    assert "['optim.scale', 'step']" in err and "--format torch" in err, err
    assert sorted(os.listdir(tmp_path)) == ["root", "src"]


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
    from cnr_torchrec.ckpt.format.bytes import storage as storage_mod
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
    """The toy model has a non-persistent buffer, which dmp.state_dict() (and so DCP) leaves out. Saved as the
    earlier docs showed it, the model nested under ``model``."""
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
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

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
