"""benchmarks/cpr.py counts what recovery reads: a tiny run under torchrun reports the bytes the full restore and the
partial recoveries read from storage, as the library counts them (``last_restore_stats``, ``RecoveryInfo``), so its
``reload_bytes_ratio`` is a number again."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.multirank


def test_the_cpr_benchmark_counts_the_bytes_each_recovery_reads(tmp_path):
    out = tmp_path / "cpr.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "benchmarks/cpr.py", "--steps", "30", "--fail-at", "25", "--interval", "10", "--eval-batches", "2",
           "--out-dir", str(tmp_path / "roots"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"cpr.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    reloaded = {name: s["bytes_reloaded"] for name, s in doc["scenarios"].items()}
    assert reloaded["none"] == 0  # no failure, no recovery
    # Every recovery read rows: a full restore every rank's chain, a partial one rank 1's shards.
    assert reloaded["full"] > 0 and reloaded["partial"] > 0 and reloaded["partial_ssu"] > 0, reloaded
    assert reloaded["partial"] < reloaded["full"], reloaded
    assert math.isfinite(doc["reload_bytes_ratio"]) and 0 < doc["reload_bytes_ratio"] < 1
