"""``examples/quickstart.py``, as the README tells a newcomer to run it: under torchrun on 2 gloo ranks, from a
directory outside the repository, where only the installed package is importable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.py")


@pytest.mark.timeout(300)
def test_the_quickstart_saves_and_restores_from_outside_the_tree(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", QUICKSTART,
         "--root", str(tmp_path / "ck")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("step", "restored"))]
    assert [line.split(":")[0] for line in lines] == ["step 5", "step 10", "step 15", "step 20", "restored step 20"]
    assert "baseline" in lines[0] and all("delta" in line for line in lines[1:4])
    assert lines[-1].endswith("dense part exact: True")
