"""Warm start: a second model, with tables renamed, dropped, added and a vocabulary regrown, filled from a
checkpoint of TorchRec's TestSparseNN (shared tables, weighted id-score tables, mixed dims, every EBC sharding
type) written by 2 ranks, onto 1 rank.

References: the source model's live rows and row-wise Adagrad state at its last save (its checkpoint stores
float32 rows, so a restore of it gives them back bit for bit), taken under the mapping; the target model's own
initial values for every row, table and column nothing maps to. Then the cases warm start refuses by name, the
model left as it was.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks

# The target model: "user_item" renamed "ui"; "pair" dropped; "abc" regrown from 56 to 80 rows through a
# vocabulary; "fresh" added; the rest (weighted tables included) kept under their names.
REGROWN = 80
KINDS = {"ui": "row_wise", "abc": "column_wise", "solo": "table_row_wise", "repl": "table_wise",
         "trio": "data_parallel", "fresh": "table_wise", "scored": "row_wise", "scored1": "column_wise"}
"""The target's plan on 1 rank: every sharding type (the source's plan "A" on 2 ranks has them all too)."""


def _config(root):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "memory_tier": "off",
                        "quantization": {"method": "none", "residual": False}})


def _source_job(rank, world_size, root, out):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp("sparse_nn", "A", seed=0)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        for i in range(2):  # a baseline and a delta
            for s in range(2):
                M.train_step(dmp, opt, M.make_batch("sparse_nn", seed=100 * i + 10 * s + rank))
            ck.save(i + 1).wait()
    tables = M.full_tables(dmp, "sparse_nn")
    dense = {k: v.detach().clone() for k, v in dmp.state_dict().items() if k.startswith("dense.")}
    if rank == 0:
        torch.save({"tables": tables, "dense": dense}, out)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    base = tmp_path_factory.mktemp("warm")
    root, out = str(base / "root"), str(base / "live.pt")
    run_ranks(_source_job, 2, args=(root, out), timeout=240)
    return root, torch.load(out)


def _target(seed=3):
    """The second model on this process's 1-rank group, sharded by TorchRec's planner."""
    import _torchrec_models as M
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP

    src = M.tables_of("sparse_nn")
    configs = {"ui": (48, 8, ["f_user", "f_item"]), "abc": (REGROWN, 16, ["f_a", "f_b", "f_c"]),
               "solo": (40, 4, ["f_solo"]), "repl": (48, 8, ["f_r1", "f_r2"]), "trio": (40, 4, ["f_x", "f_y", "f_z"]),
               "fresh": (30, 8, ["f_new"])}
    tables = [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f)
              for n, (r, d, f) in configs.items()]
    weighted = [src[t].config() for t in ("scored", "scored1")]
    torch.manual_seed(seed)
    module = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=M.NUM_FLOAT,
                          dense_device=torch.device("cpu"), sparse_device=torch.device("meta"))
    plan = M.build_plan(module, "sparse_nn", "", dist.get_world_size(), kinds=KINDS)
    return CheckNRunDMP(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                        plan=plan, sharders=M.sharders())


def _whole(dmp):
    """Every table of a 1-rank model: (weights, row-wise state or None)."""
    tracker = dmp.dirty_tracker
    out = {}
    for t in tracker.tables():
        rows, dim = tracker.table_shape(t)
        w, m = torch.zeros(rows, dim), None
        for k, s in tracker.shards(t):
            w[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] = k.tbe.split_embedding_weights()[s.local_index]
            states = k.tbe.split_optimizer_states() if hasattr(k.tbe, "split_optimizer_states") else []
            if states and states[s.local_index] and s.cols[0] == 0 and not tracker.is_data_parallel(t):
                m = torch.zeros(rows) if m is None else m
                m[s.rows[0]:s.rows[1]] = states[s.local_index][0].reshape(-1)
        out[t] = (w.clone(), m)
    return out


def _vocabularies(tmp_path):
    """The old vocabulary of "abc" (56 entries, one per row) and a new one of 80: the old entries reversed with
    every fourth one dropped, then new entries."""
    old = [f"id{i}" for i in range(56)]
    kept = [e for i, e in enumerate(reversed(old)) if i % 4]
    new = kept + [f"new{i}" for i in range(REGROWN - len(kept))]
    paths = tmp_path / "old.txt", tmp_path / "new.txt"
    paths[0].write_text("\n".join(old) + "\n")
    paths[1].write_text("\n".join(new) + "\n")
    return str(paths[0]), str(paths[1]), old, new


def test_a_changed_model_warm_starts_from_another_world_sizes_chain_row_by_row(group, source, tmp_path):
    from cnr_torchrec import vocabulary_remap, warm_start

    root, live = source
    dmp = _target()
    before = _whole(dmp)
    old_file, new_file, old, new = _vocabularies(tmp_path)
    remap = {"abc": vocabulary_remap(old_file, new_file)}
    pairs = {"ui": "user_item", "abc": "abc", "solo": "solo", "repl": "repl", "trio": "trio", "scored": "scored",
             "scored1": "scored1"}
    report = warm_start(dmp, root, tables=pairs, remap=remap, dense={"dense.": "dense."})
    after = _whole(dmp)

    for t, old_t in pairs.items():
        want_w, want_m, dp = live["tables"][old_t]
        got_w, got_m = after[t]
        rows = torch.arange(got_w.shape[0])
        src = remap[t] if t in remap else rows
        taken = src >= 0
        assert torch.equal(got_w[taken].double(), want_w[src[taken]]), t
        assert torch.equal(got_w[~taken], before[t][0][~taken]), t  # new ids keep the model's own rows
        if KINDS[t] != "data_parallel" and not dp:  # row-wise Adagrad state moved with the rows
            assert got_m is not None and torch.equal(got_m[taken].double(), want_m[src[taken]]), t
            assert report.tables[t].optimizer == "kept"
        elif dp:  # a data_parallel source table's state is the dense optimizer's: the model keeps its own
            assert got_m is None or torch.equal(got_m, before[t][1]), t
        assert report.tables[t].loaded == int(taken.sum()) and report.tables[t].fresh == int((~taken).sum())
    assert torch.equal(after["fresh"][0], before["fresh"][0])  # the added table: as initialised
    assert report.untouched == ["fresh"] and report.tables["ui"].source == "user_item"
    assert report.tables["abc"].remapped and report.tables["abc"].fresh == sum(e not in old for e in new)
    mine = {k: v for k, v in dmp.state_dict().items() if k.startswith("dense.")}
    assert mine.keys() == live["dense"].keys() and all(torch.equal(mine[k], live["dense"][k]) for k in mine)
    assert report.dense == sorted(live["dense"])


def test_warm_start_refuses_by_name_and_leaves_the_model_as_it_was(group, source):
    from cnr_torchrec import warm_start
    from cnr_torchrec.errors import ConfigError, IncompatibleCheckpointError

    root, _ = source
    dmp = _target()
    before = _whole(dmp)
    cases = [
        (dict(tables={"ui": "nope"}), ConfigError, r"holds no table \['nope'\]"),
        (dict(tables={"nope": "trio"}), ConfigError, r"the model has no table \['nope'\]"),
        (dict(tables={"ui": "abc"}), IncompatibleCheckpointError, r"'ui' has 8 columns.*'abc' 16: pass columns='fit'"),
        (dict(tables={"abc": "abc"}, remap={"abc": torch.arange(5)}), ConfigError, r"80 entries"),
        (dict(tables={"trio": "trio"}, remap={"trio": torch.full((40,), 99)}), ConfigError, r"outside \[-1, 40\)"),
        (dict(tables=["trio"], columns="wide"), ConfigError, r"columns='wide'"),
        # Fails after every table's rows were staged: nothing may have been written.
        (dict(tables={"ui": "user_item"}, dense={"over.": "over."}), IncompatibleCheckpointError,
         r"dense 'over.dhn_arch.linear0.weight' is \[16, 132\] in the model"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            warm_start(dmp, root, **kwargs)
    after = _whole(dmp)
    assert all(torch.equal(after[t][0], before[t][0]) for t in before)


def test_columns_fit_copies_the_columns_both_tables_have(group, source):
    from cnr_torchrec import warm_start

    root, live = source
    dmp = _target()
    before = _whole(dmp)
    report = warm_start(dmp, root, tables={"ui": "abc"}, columns="fit", optimizer_state="reset")
    got = _whole(dmp)["ui"][0]
    want = live["tables"]["abc"][0]
    assert torch.equal(got.double(), want[:48, :8]) and report.tables["ui"].columns == 8
    assert before["ui"][1] is not None and torch.equal(_whole(dmp)["ui"][1], before["ui"][1])  # reset: the model's


def test_without_tables_every_table_of_the_same_name_is_taken_and_a_grown_one_keeps_its_new_rows(group, source):
    from cnr_torchrec import warm_start

    root, live = source
    dmp = _target()
    before = _whole(dmp)
    report = warm_start(dmp, root)
    after = _whole(dmp)
    assert report.untouched == ["fresh", "ui"] and sorted(report.tables) == ["abc", "repl", "scored", "scored1",
                                                                             "solo", "trio"]
    assert torch.equal(after["abc"][0][:56].double(), live["tables"]["abc"][0])  # row r takes old row r
    assert torch.equal(after["abc"][0][56:], before["abc"][0][56:]) and report.tables["abc"].fresh == REGROWN - 56
    assert all(torch.equal(after[t][0], before[t][0]) for t in report.untouched)


def test_a_vocabulary_that_names_an_entry_twice_is_refused(tmp_path):
    from cnr_torchrec import vocabulary_remap
    from cnr_torchrec.errors import ConfigError

    assert vocabulary_remap(["a", "b", "c"], ["c", "x", "a"]).tolist() == [2, -1, 0]
    with pytest.raises(ConfigError, match="names 'b' twice"):
        vocabulary_remap(["a", "b", "b"], ["a"])
    with pytest.raises(ConfigError, match="vocabulary file .*missing.txt"):
        vocabulary_remap(str(tmp_path / "missing.txt"), ["a"])


def test_a_warm_started_job_saves_into_its_own_root_which_records_its_origin(group, source, tmp_path, capsys):
    from cnr_torchrec import Checkpointer, warm_start
    from cnr_torchrec.cli import main
    from cnr_torchrec.errors import ConfigError

    root, _ = source
    dmp = _target()
    report = warm_start(dmp, root, tables={"ui": "user_item"})
    with Checkpointer(dmp, _config(root)) as into_source:
        with pytest.raises(ConfigError, match="save it into a root of its own"):
            into_source.save(1)
    mine = str(tmp_path / "mine")
    with Checkpointer(dmp, _config(mine)) as ck:
        assert ck.save(1).wait().kind == "baseline"
    capsys.readouterr()
    assert main(["inspect", mine]) == 0
    out = capsys.readouterr().out
    assert f"warm-started from {root} (checkpoint {report.ckpt}, step {report.step}; 1 table(s); mapping sha256 " \
           f"{report.digest[:16]})" in out
    assert main(["inspect", mine, "--json"]) == 0
    origin = json.loads(capsys.readouterr().out)["origin"]
    assert origin["tables"] == {"ui": "user_item"} and origin["mapping_digest"] == report.digest


def test_tables_dcp_can_express_warm_start_as_dcps_partial_load_of_the_export_does(group, source, tmp_path):
    """Tables kept under their names and shapes, the case DCP's partial load expresses: a warm start gives what
    ``dcp.load(..., DefaultLoadPlanner(allow_partial_load=True))`` of ``cnr export --format dcp`` gives."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from cnr_torchrec import warm_start
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.dcp import export_dcp

    root, _ = source
    export = str(tmp_path / "dcp")
    storage = Storage(root)
    export_dcp(storage, export)
    storage.close()
    kept = ["trio", "solo", "repl", "scored", "scored1"]
    ours, theirs = _target(), _target()
    warm_start(ours, root, tables=kept, optimizer_state="reset")
    state = {k: v for k, v in theirs.state_dict().items() if any(f".{t}." in k for t in kept)}
    dcp.load(state, checkpoint_id=export, planner=DefaultLoadPlanner(allow_partial_load=True))
    a, b, fresh = _whole(ours), _whole(theirs), _whole(_target())
    for t in kept:
        assert torch.equal(a[t][0], b[t][0]) and not torch.equal(a[t][0], fresh[t][0]), t


def _mixed_job(rank, world_size, root, out):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp("mixed", "A", seed=0)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        for i in range(2):
            M.train_step(dmp, opt, M.make_batch("mixed", seed=100 * i + rank))
            ck.save(i + 1).wait()
    tables = M.full_tables(dmp, "mixed")
    if rank == 0:
        torch.save(tables, out)


def test_sequence_tables_warm_start_onto_another_plan_and_world_size(group, tmp_path):
    """TorchRec's TestMixedEmbeddingSparseArch (EmbeddingCollection tables sharing features, beside a pooled
    one) from 2 ranks on plan "A" onto 1 rank on plan "B", a sequence table renamed into another's place."""
    import _torchrec_models as M

    from cnr_torchrec import warm_start

    root, out = str(tmp_path / "root"), str(tmp_path / "live.pt")
    run_ranks(_mixed_job, 2, args=(root, out), timeout=240)
    live = torch.load(out)
    dmp, _ = M.build_dmp("mixed", "B", seed=4)
    before = _whole(dmp)
    report = warm_start(dmp, root, tables={"seq1": "seq2", "seq3": "seq3", "bag": "bag"}, columns="fit")
    after = _whole(dmp)
    assert torch.equal(after["seq1"][0][:48].double(), live["seq2"][0])  # 48 old rows into a 64-row table
    assert torch.equal(after["seq1"][0][48:], before["seq1"][0][48:]) and report.tables["seq1"].fresh == 16
    assert torch.equal(after["seq3"][0].double(), live["seq3"][0])
    assert torch.equal(after["bag"][0].double(), live["bag"][0])
    assert torch.equal(after["seq2"][0], before["seq2"][0]) and report.untouched == ["seq2"]


@pytest.mark.timeout(300)
def test_managed_collision_tables_warm_start_by_raw_id_onto_another_world_size(group, tmp_path):
    """TorchRec's ManagedCollisionEmbeddingBagCollection trained on 2 ranks (evicting every 2 steps) into a model
    of the same tables on 1 rank: every raw id the trainer held looks up, through TorchRec's own forward of the
    warm-started model, the embedding the trainer's own forward gave it at its last save."""
    import _mc_models as M
    from test_managed_collision import _held, _looked_up
    from test_publish_mc import _job

    from cnr_torchrec import CheckNRunDMP, warm_start

    saved = str(tmp_path / "saved")
    os.mkdir(saved)
    run_ranks(_job, 2, args=(str(tmp_path / "job"), "ebc", saved), timeout=240)
    want = torch.load(os.path.join(saved, "looked_up.pt"))[-1]
    model = M.build_mc_model("ebc", 1, dmp_cls=CheckNRunDMP, eviction_interval=2, seed=5)
    last = sorted(int(n) for n in os.listdir(saved) if n.isdigit())[-1]
    report = warm_start(model.dmp, os.path.join(saved, str(last)))
    assert sorted(report.tables) == ["big", "small"] and report.tables["big"].loaded == sum(t == "big" for t, _ in want)
    got = _looked_up(model, set(want))
    assert _held(model).keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def _residual_job(rank, world_size, root):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer, load_config

    config = load_config({"root": root, "policy": "consecutive", "memory_tier": "off", "compaction": None,
                          "quantization": {"method": "adaptive", "bits": 4, "residual": True}})
    dmp, opt = M.build_dmp("sparse_nn", "A", seed=0)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for i in range(3):  # a baseline and two residual deltas
            M.train_step(dmp, opt, M.make_batch("sparse_nn", seed=100 * i + rank))
            ck.save(i + 1).wait()


def test_a_residual_chain_warm_starts_to_the_bits_a_restore_of_it_gives(group, tmp_path):
    """A chain of 4-bit residual deltas (each row the sum of its copies, from zero), written by 2 ranks on plan
    "A", warm-started whole onto 1 rank on plan "B" (the regions decoded straight into the shards), against the
    restore's own reader applying the same chain to a model built the same way: bit for bit, rows and row-wise
    state, however far the model's initial values are from the checkpoint's."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer, load_config, warm_start

    root = str(tmp_path / "root")
    run_ranks(_residual_job, 2, args=(root,), timeout=240)
    warm, _ = M.build_dmp("sparse_nn", "B", seed=7)
    restored, _ = M.build_dmp("sparse_nn", "B", seed=7)
    report = warm_start(warm, root)
    with Checkpointer(restored, load_config({"root": root, "policy": "consecutive", "memory_tier": "off"})) as ck:
        ck.restore()
    got, want = _whole(warm), _whole(restored)
    assert sorted(report.tables) == sorted(want) and not report.untouched
    for t in want:
        assert torch.equal(got[t][0], want[t][0]), t
        assert (got[t][1] is None) == (want[t][1] is None) and (got[t][1] is None or torch.equal(got[t][1],
                                                                                                 want[t][1])), t
