"""One torchrun job of 2 local gloo ranks, run as a user runs it, for the tests that need a real launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def torchrun(script: str, args: list[str], *, cwd, env: dict[str, str], timeout_s: float, name: str,
             restarts: int = 0) -> tuple[int, str]:
    """Runs ``script`` under torchrun (``--standalone``, 2 ranks) from ``cwd``, with this environment but no
    PYTHONPATH, plus ``env``. Returns torchrun's exit code and its log (stdout and stderr); fails the test if
    it runs past ``timeout_s``, after killing the job's whole session."""
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"} | env
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), script, *args]
    # Its own session, so that a timeout takes the ranks down with torchrun.
    proc = subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{name}: torchrun ran past {timeout_s} s:\n{log[-3000:]}")
    return proc.returncode, log
