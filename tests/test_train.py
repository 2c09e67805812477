"""The training job: its config, metrics, plan, and a 2-rank torchrun run killed mid-way and resumed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import load_manifest
from cnr_torchrec.errors import ConfigError

from cnr_dlrm.data import DataConfig
from cnr_dlrm.dlrm import EBC_FQN, ModelConfig, build_model, plan_assignment
from cnr_dlrm.train import apply_overrides, auc, load_job_config, logloss, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import multinode  # noqa: E402


def _write(tmp_path, doc) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return str(path)


# ---------------------------------------------------------------------- config


def test_shared_tables_naming_an_unknown_feature_fail_before_training():
    cfg = load_job_config({"model": {"shared_tables": [["cat_0", "cat_99"]]}, "checkpoint": {"root": "/x"}})
    with pytest.raises(ConfigError, match="model.shared_tables: unknown feature 'cat_99'"):
        build_model(cfg.model, DataConfig(**TINY["data"]).table_rows(), [f"cat_{i}" for i in range(26)],
                    torch.device("cpu"))


@pytest.mark.timeout(60)
def test_demo_config_loads_and_sets_every_section():
    cfg = load_job_config(os.path.join(ROOT, "configs", "demo.yaml"))
    assert cfg.checkpoint.root and cfg.checkpoint.policy == "consecutive"
    assert cfg.model.dense_arch_layer_sizes[-1] == cfg.model.embedding_dim
    assert cfg.train.steps > cfg.train.checkpoint_interval
    with open(os.path.join(ROOT, "configs", "demo.yaml")) as f:
        raw = yaml.safe_load(f)
    for section in ("data", "model", "train"):
        for key, value in raw[section].items():
            got = json.loads(json.dumps(getattr(getattr(cfg, section), key)))  # tuples (of tuples) as lists
            assert got == value, (section, key)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "doc, match",
    [
        ({"trian": {}, "checkpoint": {"root": "/x"}}, r"unknown key 'trian' \(did you mean 'train'\?\)"),
        ({"data": {"zipff": 1.1}, "checkpoint": {"root": "/x"}},
         r"data: unknown key 'zipff' \(did you mean 'zipf'\?\)"),
        ({"model": {"embeding_dim": 8}, "checkpoint": {"root": "/x"}},
         r"model: unknown key 'embeding_dim' \(did you mean 'embedding_dim'\?\)"),
        ({"checkpoint": {"root": "/x", "polcy": "full"}},
         r"checkpoint: unknown key 'polcy' \(did you mean 'policy'\?\)"),
        ({"checkpoint": {"root": "/x", "quantization": {"bitz": 4}}},
         r"checkpoint: quantization: unknown key 'bitz' \(did you mean 'bits'\?\)"),
        ({"train": {"steps": "ten"}, "checkpoint": {"root": "/x"}}, r"train: steps: expected an integer"),
        ({"train": {"optimizer": "lamb"}, "checkpoint": {"root": "/x"}}, r"train: optimizer: 'lamb' is not one of"),
        ({"model": {"over_arch_layer_sizes": [8, "x"]}, "checkpoint": {"root": "/x"}},
         r"model: over_arch_layer_sizes: expected a list of integers"),
        ({"model": {"dense_arch_layer_sizes": 16}, "checkpoint": {"root": "/x"}},
         r"model: dense_arch_layer_sizes: expected a list of integers"),
        ({"model": {"embedding_dim": 8}, "checkpoint": {"root": "/x"}},
         r"model: dense_arch_layer_sizes: the last size \(16\) must equal embedding_dim \(8\)"),
        ({"model": {"over_arch_layer_sizes": [8, 2]}, "checkpoint": {"root": "/x"}}, r"last size must be 1"),
        ({"data": {"zipf": -1.0}, "checkpoint": {"root": "/x"}}, r"data: zipf: must be"),
        ({"model": {"shared_tables": ["cat_0", "cat_1"]}, "checkpoint": {"root": "/x"}},
         r"model: shared_tables: expected a list of lists of feature names"),
        ({"model": {"shared_tables": [["cat_0"]]}, "checkpoint": {"root": "/x"}},
         r"model: shared_tables: a group needs at least two features"),
        ({"model": {"shared_tables": [["cat_0", "cat_1"], ["cat_1", "cat_2"]]}, "checkpoint": {"root": "/x"}},
         r"model: shared_tables: feature 'cat_1' is in more than one place"),
        ({"train": {"checkpoint_interval": 0}, "checkpoint": {"root": "/x"}}, r"train: checkpoint_interval"),
        ({"data": 3, "checkpoint": {"root": "/x"}}, r"data: expected a mapping"),
        ({"train": {"checkpoint_interval": 5}, "checkpoint": {"root": "/x", "interval": "auto"}},
         r"both train.checkpoint_interval and checkpoint.interval are set"),
        ({"train": {}}, r"missing required key\(s\) \['checkpoint'\]"),
        ({"checkpoint": {"policy": "full"}}, r"checkpoint: missing required key\(s\) \['root'\]"),
        ("- a\n- b\n", r"top level must be a mapping"),
        ("a: [\n", r"not valid YAML"),
    ],
)
def test_config_errors_name_the_key(tmp_path, doc, match):
    with pytest.raises(ConfigError, match=match):
        load_job_config(_write(tmp_path, doc))


@pytest.mark.timeout(60)
def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_job_config(str(tmp_path / "nope.yaml"))


@pytest.mark.timeout(60)
def test_set_overrides_parse_yaml_values(tmp_path):
    path = _write(tmp_path, {"train": {"steps": 10}, "checkpoint": {"root": "/x"}})
    cfg = load_job_config(path, ["train.steps=25", "model.dense_arch_layer_sizes=[32, 8]", "model.embedding_dim=8",
                                 "checkpoint.quantization.method=none", "data.zipf=1.3", "checkpoint.root=/y"])
    assert cfg.train.steps == 25 and isinstance(cfg.train.steps, int)
    assert cfg.model.dense_arch_layer_sizes == (32, 8)
    assert cfg.checkpoint.quantization.method == "none"
    assert cfg.data.zipf == 1.3 and cfg.checkpoint.root == "/y"
    # An override of an unknown key fails like the same key in the file.
    with pytest.raises(ConfigError, match=r"unknown key 'stpes' \(did you mean 'steps'\?\)"):
        load_job_config(path, ["train.stpes=3"])
    with pytest.raises(ConfigError, match="train: steps: expected an integer"):
        load_job_config(path, ["train.steps=many"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override, match",
    [("train.steps", "expected KEY.PATH=VALUE"), ("train..steps=3", "expected KEY.PATH=VALUE"),
     ("=3", "expected KEY.PATH=VALUE"), ("train.steps=[1,", "not valid YAML"),
     ("train.steps.x=1", "'train.steps' is 10, not a section")],
)
def test_bad_set_overrides(override, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides({"train": {"steps": 10}}, [override])


@pytest.mark.timeout(60)
def test_cli_reports_config_errors_without_starting(tmp_path, capsys):
    path = _write(tmp_path, {"train": {"steps": 5}, "checkpoint": {"root": str(tmp_path / "ck")}})
    assert main(["--config", path, "--set", "train.stpes=3"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err
    assert main(["--config", path, "--fail-at-step", "9"]) == 2
    assert "--fail-at-step must be in [1, train.steps=5]" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------- metrics and plan


@pytest.mark.timeout(60)
def test_auc_matches_pairwise_definition_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 12, (300,), generator=g).double()  # many ties
    labels = (torch.rand(300, generator=g) < 0.3).double()
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    pairwise = ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()
    assert auc(scores, labels) == pytest.approx(pairwise, abs=1e-12)
    assert auc(torch.arange(4.0), torch.tensor([0.0, 0, 1, 1])) == 1.0
    assert math.isnan(auc(torch.arange(3.0), torch.ones(3)))


@pytest.mark.timeout(60)
def test_logloss_matches_formula():
    logits = torch.tensor([-2.0, 0.0, 3.0, 0.5])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0])
    p = torch.sigmoid(logits.double())
    ref = -(labels * p.log() + (1 - labels) * (1 - p).log()).mean().item()
    assert logloss(logits, labels) == pytest.approx(ref, rel=1e-12)


@pytest.mark.timeout(60)
def test_plan_splits_big_tables_by_rows_and_balances_the_rest():
    rows = dict(zip([f"t{i}" for i in range(26)], DataConfig(scale=0.01, min_rows=16).table_rows()))
    a = plan_assignment(rows, 16, 2, 10_000)
    assert {n for n, w in a.items() if w == "row_wise"} == {n for n, r in rows.items() if r >= 10_000}
    load = [sum(rows[n] for n, w in a.items() if w == r) for r in range(2)]
    small = sorted((r for r in rows.values() if r < 10_000), reverse=True)
    assert abs(load[0] - load[1]) <= small[0]  # greedy largest-first stays within the largest table
    assert plan_assignment(rows, 16, 2, 10_000) == a  # every rank computes the same plan
    assert all(w == 0 for w in plan_assignment(rows, 16, 1, 10_000).values())


# ---------------------------------------------------------------------- the job under torchrun

# The job of the torchrun tests (tiny tables, two shared by several features), shared with benchmarks/multinode.py.
TINY = multinode.TINY
CHECKPOINT_KEYS = {"id": int, "step": int, "kind": str, "method": str, "bits": (int, type(None)), "rows_written": int,
                   "total_rows": int, "dirty_fraction": float, "nbytes": int, "stall_ms": float, "write_ms": float}


def _torchrun(config: str, root: str, dump: str, *extra: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "1", "-m", "cnr_dlrm.train", "--config", config, "--set", f"checkpoint.root={root}",
           "--dump-state", dump, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    if ok:
        assert proc.returncode == 0, (f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                      f"{proc.stderr[-5000:]}")
    return proc


def _dense_snapshot_bytes(cfg) -> int:
    """Dense parameters and their Adagrad state (sum + a float32 step per tensor), from an unsharded model."""
    model = build_model(cfg, DataConfig(**TINY["data"]).table_rows(), [f"cat_{i}" for i in range(26)],
                        torch.device("cpu"))
    dense = [p for n, p in model.named_parameters() if not n.startswith(EBC_FQN)]
    return sum(p.numel() for p in dense) * 4 * 2 + len(dense) * 4


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_killed_job_resumes_and_matches_an_uninterrupted_run(tmp_path):
    config = _write(tmp_path, TINY)
    failed = _torchrun(config, str(tmp_path / "ck_fail"), str(tmp_path / "dump_fail"),
                       "--fail-at-step", "11", "--fail-rank", "1")
    straight = _torchrun(config, str(tmp_path / "ck_straight"), str(tmp_path / "dump_straight"))
    assert "injected failure at step 11" in failed.stderr
    assert "injected failure" not in straight.stderr
    assert "restores: 1" in failed.stdout and "restores: 0" in straight.stdout

    with open(tmp_path / "ck_fail" / "report.json") as f:
        report = json.load(f)
    with open(tmp_path / "ck_straight" / "report.json") as f:
        ref = json.load(f)

    # Schema (what `python -m cnr_dlrm.report` reads).
    assert report["format"] == "cnr-report" and report["version"] == 1
    assert report["world_size"] == 2 and isinstance(report["full_snapshot_nbytes"], int)
    assert set(report["eval"]) == {"logloss", "auc"} and all(isinstance(v, float) for v in report["eval"].values())
    for c in report["checkpoints"]:
        assert set(c) == set(CHECKPOINT_KEYS)
        for k, tp in CHECKPOINT_KEYS.items():
            assert isinstance(c[k], tp) and not isinstance(c[k], bool), (k, c[k])

    # One restore, from the newest checkpoint committed before the kill (step 8, or 4 if 8 was still writing).
    assert report["restores"] == 1 and ref["restores"] == 0
    assert [r["step"] for r in report["restored_from"]] in ([8], [4])
    assert report["start_step"] == report["restored_from"][0]["step"]
    # Every interval step was checkpointed exactly once among the commits, baseline first.
    assert [c["step"] for c in report["checkpoints"]] == [4, 8, 12]
    assert [c["kind"] for c in report["checkpoints"]] == ["baseline", "delta", "delta"]
    ids = [c["id"] for c in report["checkpoints"]]
    assert ids == sorted(ids) and len(set(ids)) == 3

    # Sizes against an independent count and against the manifests on disk.
    # Rows of the model's tables, counted here from the config: a shared table has as many rows as the
    # largest cardinality among its features, and counts once.
    feature_rows = dict(zip([f"cat_{i}" for i in range(26)], DataConfig(**TINY["data"]).table_rows()))
    groups = TINY["model"]["shared_tables"]
    shared = {f for g in groups for f in g}
    rows = [max(feature_rows[f] for f in g) for g in groups] + [r for f, r in feature_rows.items() if f not in shared]
    dim = TINY["model"]["embedding_dim"]
    expected_full = sum(rows) * dim * 4 + sum(rows) * 4 + _dense_snapshot_bytes(
        ModelConfig(**{k: tuple(map(tuple, v)) if k == "shared_tables" else tuple(v) if isinstance(v, list) else v
                       for k, v in TINY["model"].items()}))
    assert report["full_snapshot_nbytes"] == expected_full == ref["full_snapshot_nbytes"]
    storage = Storage(str(tmp_path / "ck_fail"))
    try:
        for c in report["checkpoints"]:
            m = load_manifest(storage, c["id"])
            assert (m.step, m.kind, m.nbytes) == (c["step"], c["kind"], c["nbytes"])
            assert c["rows_written"] == sum(r.rows_written for r in m.ranks)
            assert c["total_rows"] == sum(rows) and c["method"] == "none"
            assert c["dirty_fraction"] == pytest.approx(c["rows_written"] / sum(rows))
    finally:
        storage.close()
    assert report["checkpoints"][0]["rows_written"] == sum(rows)
    assert all(0 < c["rows_written"] < sum(rows) for c in report["checkpoints"][1:])

    # fp32 checkpoints restore exactly and the replay sees the same batches (the reader resumes at the
    # restored step), so the resumed run ends bit for bit where the uninterrupted one does.
    seen_tables = set()
    for rank in range(2):
        a = torch.load(tmp_path / "dump_fail" / f"rank-{rank:05d}.pt", weights_only=True)
        b = torch.load(tmp_path / "dump_straight" / f"rank-{rank:05d}.pt", weights_only=True)
        assert a.keys() == b.keys()
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, f"rank {rank}: {unequal[:5]}"
        seen_tables |= {k.split("/")[1] for k in a if k.startswith("emb/")}
        assert any(k.startswith("dense_opt/") for k in a) and any(k.startswith("emb_state0/") for k in a)
    assert seen_tables == {"t_cat_0", "t_cat_2"} | {f"t_{f}" for f in feature_rows if f not in shared}
    assert report["eval"] == ref["eval"]
    assert report["last_loss"] == ref["last_loss"]


class _Checkpoint:
    """The parts of a manifest that the model check reads."""

    def __init__(self, tables):
        self.id, self.tables = 7, tables


class _Tracker:
    def __init__(self, tables):
        self._tables = tables

    def tables(self):
        return list(self._tables)

    def table_shape(self, table):
        return self._tables[table]


def test_another_models_checkpoint_is_refused_in_one_line_naming_a_few_differences():
    from cnr_torchrec.ckpt.restore.compat import check_compatible
    from cnr_torchrec.errors import IncompatibleCheckpointError

    saved = {f"t{i:02d}": [100 + i, 8] for i in range(26)}
    model = {t: [2 * rows, dim] for t, (rows, dim) in saved.items()}  # every table twice the rows (data.scale)
    model["t_new"] = [5, 8]
    with pytest.raises(IncompatibleCheckpointError) as e:
        check_compatible(_Checkpoint(saved), _Tracker(model))
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert msg == ("checkpoint 7 is of another model (27 difference(s)): table 't_new' is in the model but not in "
                   "the checkpoint; 't00' is 200 x 8 in the model but 100 x 8 in the checkpoint; 't01' is 202 x 8 in "
                   "the model but 101 x 8 in the checkpoint; and 24 more. Use a new root, or restore with the model "
                   "that wrote it")
    check_compatible(_Checkpoint(saved), _Tracker(saved))  # the same model: no error


@pytest.mark.multirank
@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_job_resumed_on_another_models_root_fails_in_one_line(tmp_path):
    config = _write(tmp_path, {**TINY, "train": {**TINY["train"], "steps": 4}})
    root = str(tmp_path / "ck")
    _torchrun(config, root, str(tmp_path / "dump"))
    other = _torchrun(config, root, str(tmp_path / "dump2"), "--set", "data.scale=0.001", ok=False)
    assert other.returncode != 0
    # The job's own lines: no traceback from any rank, the message once, then torchrun's own report of a failure
    # (its restart and its block, which the job cannot shorten).
    ours = ROOT + os.sep + "cnr_"
    assert ours not in other.stderr and "[rank" not in other.stderr, other.stderr
    errors = [line for line in other.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, other.stderr  # one per incarnation: torchrun restarts the job once
    first, again = errors
    assert first.startswith("error: IncompatibleCheckpointError: rank 0, restoring checkpoint 0: checkpoint 0 is "
                            "of another model (")
    assert first.endswith("; and 4 more. Use a new root, or restore with the model that wrote it")
    assert first.count(" in the model but ") == 3 and len(first) < 500
    assert again == ("error: IncompatibleCheckpointError again after torchrun restarted the job (the same message "
                     "as above)")
    pointers = [line for line in other.stderr.splitlines() if line.startswith("rank ")]
    assert all(line == "rank 1 failed, see rank 0" for line in pointers), pointers  # unless torchrun killed it
