"""Every benchmark command the README, the Makefile and the docs name for a figure runs to completion, at its
smallest size (seconds each): the command a reader copies must not crash. Figures are not checked here; each
run must exit 0 and print the line its summary starts with.

Already run elsewhere at small sizes: ``benchmarks/accuracy.py`` (``test_accuracy_bench.py``), ``cpr.py``,
``multinode.py`` and ``reliability.py`` (their own tests).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

# name: (the command, beside the repository root; a line its output must hold)
COMMANDS = {
    "tracking": (TORCHRUN + ["benchmarks/tracking.py", "--rows", "2000", "--tables", "2", "--batch-size", "64",
                             "--pooling", "4", "--rounds", "2", "--steps", "2", "--extractions", "2"], "overhead"),
    "checkpoint": (TORCHRUN + ["benchmarks/checkpoint.py", "--rows", "2000", "--tables", "2", "--batch-size", "64",
                               "--pooling", "4", "--steps-per-interval", "1", "--intervals", "2", "--reps", "1"],
                   "default"),
    "scale": (TORCHRUN + ["benchmarks/scale.py", "--sizes", "0.01", "--dirty", "0.1", "--deltas", "2",
                          "--reps", "1", "--batch-size", "256"], "x0.01"),
    "publish": (TORCHRUN + ["benchmarks/publish.py", "--sizes", "0.01", "--int8-sizes", "0.01", "--dirty", "0.1",
                            "--deltas", "2", "--batch-size", "256"], "x0.01"),
    "warm_start": (TORCHRUN + ["benchmarks/warm_start.py", "--sizes", "0.01", "--deltas", "1", "--repeats", "1",
                               "--batch-size", "256"], "x0.01"),
    "mc_delta": ([sys.executable, "benchmarks/mc_delta.py", "--rows", "2000", "--dim", "16"], "delta"),
    "metadata_scale": ([sys.executable, "benchmarks/metadata_scale.py", "--worlds", "2", "--layouts", "table8",
                        "--depth", "2"], "x DCP"),
    "recovery": ([sys.executable, "benchmarks/recovery.py", "--sizes", "0.01", "--cells", "kept,off", "--nproc", "2",
                  "--saves", "2", "--batch-size", "256"], "kill->step"),
    "exit_race": ([sys.executable, "benchmarks/exit_race.py", "--jobs", "1", "--rounds", "2"], "aborted at exit"),
    "soak": (TORCHRUN + ["benchmarks/soak.py", "--quick", "--checkpoints", "6", "--rows", "2000", "--every", "3"],
             "checkpoints"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_documented_benchmark_runs_at_its_smallest_size(name, tmp_path):
    cmd, expect = COMMANDS[name]
    if "--out-dir" not in cmd and name not in ("mc_delta", "metadata_scale", "tracking", "exit_race"):
        cmd = [*cmd, "--out-dir", str(tmp_path / "out")]
    if name == "recovery":  # its hosts' memory images, apart from any other run's
        cmd = [*cmd, "--shm", str(tmp_path / "shm")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{log[-3000:]}"
    assert expect in proc.stdout, f"{' '.join(cmd)} printed no {expect!r}:\n{proc.stdout[-2000:]}"
