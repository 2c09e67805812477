"""Times a newcomer's first ``make demo``: a bare clone, then the venv, the extension build and the job.

Each revision is cloned into a new folder and ``make demo`` runs there, its lines stamped as they
arrive. The phases are read off the commands make echoes: the venv from the start to the
extension's ``pip install -e .``, the build from there to ``torchrun``, the job from there to the end.
With ``--drop-caches`` (root only) the page cache is dropped before each clone, so that every
revision starts from a cold disk as a fresh machine does. Run it on an idle machine: the
revisions run one after the other, and the figures are only comparable within one run.

    python benchmarks/first_run.py HEAD aee5fa6 --drop-caches --json out/first-run.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PHASES = ("venv", "build", "job")


def drop_caches() -> bool:
    """Drops the page cache; False where this process may not."""
    subprocess.run(["sync"], check=True)
    try:
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def phase_starts(lines: list[tuple[float, str]]) -> dict[str, float]:
    """When each phase began, from the commands ``make`` echoed (seconds since the start)."""
    starts = {"venv": 0.0}
    for t, line in lines:
        if "build" not in starts and "pip install" in line and line.rstrip().endswith("-e ."):
            starts["build"] = t
        elif "job" not in starts and "torchrun" in line:
            starts["job"] = t
    missing = [p for p in PHASES if p not in starts]
    if missing:
        raise RuntimeError(f"make demo's output shows no start of {missing}; was the extension already built?")
    return starts


def first_run(rev: str, cold: bool) -> dict:
    """One revision's first ``make demo``, from a bare clone: seconds per phase and in all."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="cnr-first-run-"))
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(work)], check=True)
        subprocess.run(["git", "checkout", "-q", rev], cwd=work, check=True)
        dropped = drop_caches() if cold else False
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
        start = time.monotonic()
        proc = subprocess.Popen(["make", "demo"], cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        lines = [(time.monotonic() - start, line) for line in proc.stdout]
        total = time.monotonic() - start
        if proc.wait() != 0:
            tail = "".join(line for _, line in lines[-20:])
            raise RuntimeError(f"make demo failed at {rev}:\n{tail}")
        starts = phase_starts(lines)
        ends = [starts["build"], starts["job"], total]
        seconds = {p: round(end - starts[p], 1) for p, end in zip(PHASES, ends)}
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=work, check=True,
                                capture_output=True, text=True).stdout.strip()
        return {"rev": rev, "commit": commit, "cold": dropped, **seconds, "total": round(total, 1)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revs", nargs="*", default=["HEAD"], help="revisions to time; the first is the reference")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before each clone (root)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    args = parser.parse_args(argv)

    rows = []
    for rev in args.revs:
        rows.append(first_run(rev, args.drop_caches))
        print(f"{rev}: {rows[-1]}", flush=True)
    ref = rows[0]["total"]
    print(f"\n{'revision':<12} {'commit':<9} {'cold':<5} {'venv s':>7} {'build s':>8} {'job s':>6} {'total s':>8} {'vs first':>9}")
    for r in rows:
        print(f"{r['rev']:<12} {r['commit']:<9} {str(r['cold']):<5} {r['venv']:>7.0f} {r['build']:>8.0f} "
              f"{r['job']:>6.0f} {r['total']:>8.0f} {r['total'] / ref:>8.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
