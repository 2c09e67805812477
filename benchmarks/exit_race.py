"""How often a finished 2-rank gloo job aborts at interpreter exit, with cnr_torchrec's exit handler and without.

    python benchmarks/exit_race.py --jobs 40 --json out/exit_race.json

Each job is torchrun with 2 local ranks whose last lines are what training jobs end with: rounds of
``all_reduce`` and ``all_gather_object``, then ``destroy_process_group()``, with the group still referenced (as a
model holds it). A gloo worker thread that asks for the GIL once the interpreter is finalizing aborts its process
(``terminate called without an active exception``, exit -6; cnr_torchrec/_exit.py says why). The two arms run
alternately, and differ only in whether the handler is registered: both load ``cnr_torchrec/_exit.py`` by path,
without importing the package, so that they start alike. Prints the aborted jobs of each arm and the handler's
wait per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = r"""
import importlib.util, os, sys
import torch
import torch.distributed as dist

spec = importlib.util.spec_from_file_location("cnr_exit", os.path.join(sys.argv[1], "cnr_torchrec", "_exit.py"))
cnr_exit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cnr_exit)
if sys.argv[2] == "on":
    import atexit
    atexit.register(lambda: print(f"waited {cnr_exit.settle_collective_threads() * 1e3:.1f} ms", flush=True))

dist.init_process_group("gloo")
group = dist.group.WORLD  # referenced past destroy_process_group(), as a model references it
for i in range(int(sys.argv[3])):
    t = torch.ones(1000)
    dist.all_reduce(t)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"round": i})
dist.destroy_process_group()
"""


def run_job(script: str, arm: str, rounds: int, timeout: float) -> tuple[bool, list[float]]:
    """One torchrun job; whether it aborted, and the handler's waits (ms) its ranks printed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, REPO, arm,
           str(rounds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    log = out.stdout + out.stderr
    aborted = "terminate called" in log or out.returncode != 0
    return aborted, [float(m) for m in re.findall(r"waited ([0-9.]+) ms", log)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=40, help="jobs per arm")
    parser.add_argument("--rounds", type=int, default=20, help="collective rounds before the exit")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        aborted = {"off": 0, "on": 0}
        waits: list[float] = []
        for i in range(args.jobs):
            for arm in ("off", "on"):
                bad, w = run_job(script, arm, args.rounds, args.timeout)
                aborted[arm] += bad
                waits += w
            print(f"job {i + 1}/{args.jobs}: aborted without the handler {aborted['off']}, with it {aborted['on']}",
                  flush=True)
    result = {"jobs": args.jobs, "rounds": args.rounds, "aborted_without_handler": aborted["off"],
              "aborted_with_handler": aborted["on"],
              "handler_wait_ms": {"median": statistics.median(waits) if waits else None,
                                  "max": max(waits) if waits else None}}
    print(f"aborted at exit: {aborted['off']} of {args.jobs} jobs without the handler, {aborted['on']} of "
          f"{args.jobs} with it; the handler waited {result['handler_wait_ms']['median']} ms per rank (median), "
          f"{result['handler_wait_ms']['max']} ms at most")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
