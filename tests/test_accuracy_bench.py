"""Smoke test of the accuracy study's machinery (benchmarks/accuracy.py) on a tiny task.

The study's runs are real: a CheckNRunDMP trained on the synthetic stream, saved and restored
by the Checkpointer. Checked against the no-failure run of the same seed and data: fp32 restores
change nothing (the logits are bit-identical), and quantization error shows in the logloss in the
order a user would expect (2-bit restored 20 times hurts, 8-bit restored once barely moves it).
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from cnr_torchrec.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import accuracy  # noqa: E402
import accuracy_seeds  # noqa: E402
from _dist import run_ranks  # noqa: E402


def _tiny_args(out_dir: str) -> argparse.Namespace:
    return argparse.Namespace(steps=60, scale=0.0005, min_rows=64, batch_size=128, eval_samples=8192, dim=16,
                              lr=0.05, schedule="linear", signal=2.0, zipf=1.05, row_wise_min_rows=5000,
                              policy="consecutive", out_dir=out_dir, seed=0)


def _study_worker(rank: int, world: int, out_dir: str) -> None:
    import torch

    args = _tiny_args(out_dir)
    task = accuracy.make_task(args)
    labels = torch.cat([e.labels for e in task.eval])
    ref = accuracy.train_run(args, task)

    exact = accuracy.compare(accuracy.train_run(args, task, method="none", restores=20), ref, labels)
    assert exact["identical"], f"fp32 save + restore changed the model: {exact}"
    assert exact["dlogloss_rel"] == 0.0 and exact["ckpt_bytes"] > 0

    mild = accuracy.compare(accuracy.train_run(args, task, method="uniform_asym", bits=8, restores=1), ref, labels)
    harsh = accuracy.compare(accuracy.train_run(args, task, method="uniform_asym", bits=2, restores=20), ref, labels)
    assert not mild["identical"] and not harsh["identical"]  # the codec did reach the model
    assert harsh["dlogloss_rel"] > 5 * harsh["se_rel"], harsh  # a real degradation, far out of the eval noise
    assert abs(mild["dlogloss_rel"]) < harsh["dlogloss_rel"] / 10, (mild, harsh)

    # The residual arm with background compaction: its chains are folded while the run goes on (a save every
    # 5 steps, folds every 2 deltas), and the run's restore still comes back where it was saved.
    folding = argparse.Namespace(**{**vars(args), "residual": True, "compaction": 2, "interval": 5})
    run = accuracy.train_run(folding, task, method="uniform_asym", bits=2, restores=1)
    assert run["folds"] >= 2, run["folds"]
    again = accuracy.train_run(folding, task, method="uniform_asym", bits=2, restores=1)
    assert again["folds"] == run["folds"] and torch.equal(again["logits"], run["logits"])  # the same folds
    assert not os.listdir(out_dir), "a cell's checkpoint root was left behind"


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_quantized_restores_degrade_in_order_and_fp32_is_exact(tmp_path) -> None:
    run_ranks(_study_worker, world_size=1, timeout=110, args=(str(tmp_path),))


def test_restore_steps_are_spread_over_the_run() -> None:
    assert accuracy.restore_steps(1000, 1) == [500]
    assert accuracy.restore_steps(1000, 3) == [250, 500, 750]
    points = accuracy.restore_steps(1000, 20)
    gaps = {b - a for a, b in zip(points, points[1:])}
    assert len(points) == 20 and gaps <= {47, 48} and points[0] == 48 and points[-1] == 952
    with pytest.raises(ConfigError, match="raise --steps"):
        accuracy.restore_steps(10, 20)


def test_lr_decays_linearly_to_zero() -> None:
    args = argparse.Namespace(lr=0.05, steps=100, schedule="linear")
    assert accuracy.lr_at(args, 1) == 0.05
    assert accuracy.lr_at(args, 51) == pytest.approx(0.025)
    assert accuracy.lr_at(args, 100) == pytest.approx(0.0005)
    args.schedule = "constant"
    assert accuracy.lr_at(args, 100) == 0.05


# ---------------------------------------------------------------------- bits: auto's table from the studies

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "data")


def _study(task: str, cells: dict[tuple[int, int], tuple[float, float]], floor: dict[int, float]) -> dict:
    """A study's --json as accuracy.py writes it, for the adaptive widths and restores in ``cells``."""
    out = {f"adaptive_{b}_{r}": {"dlogloss_rel": d, "se_rel": se} for (b, r), (d, se) in cells.items()}
    widths: dict = {}
    for (b, r), (d, _) in cells.items():
        widths.setdefault(f"adaptive_{b}", {})[str(r)] = d
    out["dlogloss"] = {task: widths}
    out["floor"] = {task: {str(r): f for r, f in floor.items()}}
    return out


def test_recommendation_takes_the_margin_the_floor_and_the_widest_need():
    ok, bad = (0.0, 0.00001), (0.0002, 0.00001)
    a = _study("a", {(4, 1): ok, (8, 1): ok, (4, 3): bad, (8, 3): ok, (4, 20): bad, (8, 20): ok},
               {1: 0.0, 3: 0.0, 20: 0.0})
    assert accuracy.recommend_bits_table([a]) == {1: 4, 20: 8}
    # Within 0.01% but not with 1 SE of margin: 4-bit fails at R=1.
    b = _study("b", {(4, 1): (0.00009, 0.00002), (8, 1): ok}, {1: 0.0})
    assert accuracy.recommend_bits_table([b]) == {1: 8}
    # A floor above 0.01% lets a cell within it pass; the widest need over two studies wins.
    c = _study("c", {(4, 1): (0.0003, 0.00001), (8, 1): ok}, {1: 0.001})
    assert accuracy.recommend_bits_table([c]) == {1: 4}
    assert accuracy.recommend_bits_table([c, b]) == {1: 8}
    # No width passes at R=20: the table ends before it (bits: auto then takes fallback_bits).
    d = _study("d", {(4, 1): ok, (8, 1): ok, (4, 20): bad, (8, 20): bad}, {1: 0.0, 20: 0.0})
    assert accuracy.recommend_bits_table([d]) == {1: 4}
    # A larger R never gets fewer bits, even where its own cells would pass with them.
    e = _study("e", {(4, 1): bad, (8, 1): ok, (4, 3): ok, (8, 3): ok}, {1: 0.0, 3: 0.0})
    assert accuracy.recommend_bits_table([e]) == {3: 8}


@pytest.mark.parametrize("residual", [False, True])
def test_the_default_bits_tables_are_the_committed_studies_recommendation(residual):
    """bits: auto's tables, with and without quantization.residual, against the studies run that way, each
    combined over its seeds (and, for residual coding, the arm with background compaction too)."""
    import json

    from cnr_torchrec.ckpt.config import DEFAULT_BITS_TABLE, RESIDUAL_BITS_TABLE

    arms = ["harsh-residual", "production-residual", "production-residual-compaction"] if residual else [
        "harsh", "production"]
    studies = []
    for arm in arms:
        with open(os.path.join(DATA, f"accuracy-{arm}-seeds.json")) as f:
            studies.append(json.load(f))
        assert set(studies[-1]["dlogloss"]) == {arm.split("-")[0]}
        assert studies[-1]["_study"]["config"].get("residual", False) == residual
    assert accuracy.recommend_bits_table(studies) == (RESIDUAL_BITS_TABLE if residual else DEFAULT_BITS_TABLE)


def test_seeds_combine_into_their_mean_with_the_larger_standard_error() -> None:
    """Two seeds of the committed production study (the second shifted by 0.004% in every cell and control):
    each cell is their mean; its SE is the larger of the pooled paired SE and the seeds' spread; the floors
    come from the combined controls, and bits: auto's rule reads the result."""
    import copy
    import json
    import math

    with open(os.path.join(REPO, "docs", "data", "accuracy-production.json")) as f:
        one = json.load(f)
    two = copy.deepcopy(one)
    two["_study"]["config"]["seed"] = 1
    shift = 4e-5
    for k, c in two.items():
        if not k.startswith("_") and k not in ("dlogloss", "floor", "bits_per_row"):
            c["dlogloss_rel"] += shift
    for c in two["_study"]["controls"].values():
        c["dlogloss_rel"] += shift
    both = accuracy_seeds.combine_seeds([one, two])
    cell, a = both["adaptive_4_3"], one["adaptive_4_3"]
    assert cell["dlogloss_rel"] == pytest.approx(a["dlogloss_rel"] + shift / 2)
    assert cell["paired_se_rel"] == pytest.approx(math.sqrt(2) * a["se_rel"] / 2)
    assert cell["seed_se_rel"] == pytest.approx(shift / 2)
    assert cell["se_rel"] == max(cell["paired_se_rel"], cell["seed_se_rel"]) and cell["seeds"] == [0, 1]
    fp16 = both["_study"]["controls"]["fp16_3"]
    want_floor = max(abs(both["_study"]["controls"][f"{m}_3"]["dlogloss_rel"]) + 2 * both["_study"]["controls"][
        f"{m}_3"]["se_rel"] for m in ("fp16", "bf16"))
    assert both["floor"]["production"]["3"] == pytest.approx(want_floor) and fp16["seeds"] == [0, 1]
    assert accuracy.recommend_bits_table([both])  # the rule reads a combined study as it reads one
    two["_study"]["config"]["steps"] = 500
    with pytest.raises(ValueError, match="differ in \\['steps'\\]"):
        accuracy_seeds.combine_seeds([one, two])


def test_an_arm_without_controls_takes_another_arms_of_the_same_task() -> None:
    """The compaction arm runs no controls: the residual arm's stand in (same task, differing only in residual
    coding and compaction); a study of another task is refused."""
    import copy
    import json

    with open(os.path.join(REPO, "docs", "data", "accuracy-production-residual.json")) as f:
        residual = json.load(f)
    arm = copy.deepcopy(residual)
    arm["_study"]["config"].update(compaction=4, no_controls=True)
    arm["_study"]["controls"] = {}
    with pytest.raises(ValueError, match="none of the studies ran the controls"):
        accuracy_seeds.combine_seeds([arm])
    both = accuracy_seeds.combine_seeds([arm], [residual])
    assert both["_study"]["controls"]["fp16_3"]["dlogloss_rel"] == residual["_study"]["controls"]["fp16_3"][
        "dlogloss_rel"]
    assert both["floor"]["production"] == pytest.approx(
        {r: f for r, f in residual["_study"]["floor_rel"].items()})
    with open(os.path.join(REPO, "docs", "data", "accuracy-harsh-residual.json")) as f:
        other_task = json.load(f)
    with pytest.raises(ValueError, match="--controls-from: a study that differs in"):
        accuracy_seeds.combine_seeds([arm], [other_task])
