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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import accuracy  # noqa: E402
from _dist import run_ranks  # noqa: E402


def _tiny_args(out_dir: str) -> argparse.Namespace:
    return argparse.Namespace(steps=60, scale=0.0005, min_rows=64, batch_size=128, eval_samples=8192, dim=16,
                              lr=0.05, schedule="linear", signal=2.0, zipf=1.05, row_wise_min_rows=5000,
                              policy="consecutive", out_dir=out_dir)


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
