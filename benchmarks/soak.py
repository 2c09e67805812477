"""Soak: 500 consecutive checkpoints with background compaction, against the same job without it.

Run on 2 ranks:  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/soak.py [--json PATH]
Smoke run:       ... benchmarks/soak.py --quick   (60 checkpoints of 50k-row tables, about 20 s)
Residual chains: ... benchmarks/soak.py --residual   (the compaction job codes residuals and folds them)

Workload: the reference one of benchmarks/checkpoint.py, whose ``build`` and ``step`` this file
imports (ToyModel, 8 tables x 32 dim, half row_wise and half table_wise, Zipf(1.05) ids, pooling
20, EXACT_ROWWISE_ADAGRAD, gloo on CPU), checkpointed by policy consecutive at 4-bit adaptive with
the compact storage (float16 row bias, bfloat16 optimizer row state), every ``--steps-per-interval``
steps, ``--checkpoints`` times. Saves are not waited for (``on_busy: wait``, the default: a save
waits only for the one before it).

Two jobs, each a freshly built model (same seed) fed the same batches, so they checkpoint the same
model states: "compaction" (``compaction: {max_chain: 16}``, ``keep: {checkpoints: 1}``) and
"plain" (the same without compaction). With ``--residual`` the compaction job also sets
``quantization.residual: true``, so its compactions are folds of residual chains
(docs/compaction.md), while the plain job stays as it is: plain coding, no compaction, the job
the residual one must not be slower than. ``max_chain: 16`` bounds a restore to one baseline and
16 deltas, plus the few written while a merge runs, while a compaction (a baseline's worth of
reading and writing) is paid once every 16 saves, and 500 checkpoints still see about 30 of them.
``keep: {checkpoints: 1}`` keeps only what the newest checkpoint needs, so whatever else stays
under the root is garbage that retention failed to collect; the plain job keeps its whole chain
anyway, because the newest checkpoint needs all of it.

The jobs alternate in blocks, in this one process: compaction runs up to the next report point,
then plain runs the same checkpoints, and so on (report points: checkpoint 10, every ``--every``
checkpoints, and the last), so that the machine's drift hits both alike. At a report point each
job waits for its save in flight and for its compaction (``wait(compaction=True)``), then its
figures are taken; none of that is inside the timed figures. The price: a compaction in flight at
a report point finishes while the job is paused instead of beside its next saves.

Figures (every checkpoint is numbered 1..N in save order; checkpoint 1 is the baseline):
  stall ms: how long ``save()`` blocked the training loop (with ``on_busy: wait``, that includes
      waiting for the previous save's write); the slowest rank's, per checkpoint.
  commit ms: from the ``save()`` call to its commit, i.e. to ``handle.wait()`` returning (timed by
      a watcher thread, so the loop never waits): stall, encode, write, rank 0's manifest and
      retention; the slowest rank's. ``commit_ms_first50``/``last50`` are the medians of the first
      and last 50 checkpoints (of N/2 when N < 100).
  stored bytes: every file under the job's root (os.walk), at a report point.
  chain: checkpoints in the newest checkpoint's chain (newest by step, then id), baseline included.
  restore ms: a fresh model (same seed) and a fresh Checkpointer on the job's config restore the
      newest checkpoint, on both ranks (the slowest rank's, from a barrier); the step it returns
      is checked against the job's. ``restore_ms_10`` and ``restore_ms_<N>``: at checkpoints 10, N.
  train ms: wall time of the training steps between two saves (median), where background
      writing and merging show up as a slower loop rather than as stall.
Targets (the compaction job):
  commit_ms_last50 <= 1.2 x commit_ms_first50;
  stored bytes at the end <= 2 x one baseline (the first one's directory) + the deltas of the
      newest chain (the deltas since the last compaction, whose directories are counted whole);
  restore_ms_<N> <= 1.2 x restore_ms_10;
  median stall <= 1.1 x the plain job's (``stall_ratio_compaction_vs_plain``).

Sizing: the defaults are benchmarks/checkpoint.py's own (200k rows per table, batch 2048 per rank,
4 steps per interval: ~27% of the rows dirty per interval, a 35 MB baseline, ~10 MB deltas). An
interval is 0.35-0.55 s of training on the 2-core dev VM, so the 2 x 500 intervals take 6-9 minutes;
with the restores, the model builds and the plain job's growing chain (5 GB under --out-dir at the
end, and a 2 s restore), the measured wall time was 9.6 minutes (563 s after start-up, with other
jobs sharing the machine): well within a 25-minute budget, with room for a slower machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import queue
import statistics
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

from cnr_torchrec import Checkpointer, load_config
from cnr_torchrec.ckpt.format.commits import ckpt_dir

# The repository root, for the example job and models (cnr_dlrm, examples), which are not in the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.toy import TableSpec, zipf_batch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint import COMPACT, build, dir_bytes, finish, fresh_dir, slowest, step, timed  # noqa: E402

QUANT = {"method": "adaptive", "bits": 4, **COMPACT}
QUICK = {"checkpoints": 60, "rows": 50_000, "batch_size": 512, "steps_per_interval": 2, "every": 10}


class CommitClock:
    """Times saves from their ``save()`` call to their commit, on a thread of its own.

    Saves commit in order (one background writer per Checkpointer), so one thread that
    waits on each handle in turn sees each commit as it happens. A save that fails is
    timed as -1 and its error kept.
    """

    def __init__(self) -> None:
        self.ms: list[float] = []
        self.errors: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="soak-commit-clock", daemon=True).start()

    def watch(self, t0: float, handle) -> None:
        self._queue.put((t0, handle))

    def drain(self) -> None:
        """Returns once every save handed in has committed (or failed)."""
        self._queue.join()

    def _loop(self) -> None:
        while True:
            t0, handle = self._queue.get()
            try:
                handle.wait()
                self.ms.append((time.perf_counter() - t0) * 1e3)
            except Exception as e:  # noqa: BLE001 - counted and reported, the soak goes on
                self.ms.append(-1.0)
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                self._queue.task_done()


class Job:
    """One training job checkpointing under its own root; per checkpoint, the slowest rank's figures."""

    def __init__(self, name: str, specs: list[TableSpec], args, root: str, compaction: bool) -> None:
        self.name, self.specs, self.args, self.root = name, specs, args, root
        self.dmp, self.opt = build(specs, dist.get_world_size())
        quant = {**QUANT, "residual": compaction and args.residual}
        config = {"root": root, "policy": "consecutive", "quantization": quant, "keep": {"checkpoints": 1},
                  "compaction": {"max_chain": args.max_chain} if compaction else None}  # None: not the default's
        self.config = load_config(config)
        self.ck = Checkpointer(self.dmp, self.config, dense_optimizer=self.opt)
        self.gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # the same batches in both jobs
        self.clock = CommitClock()
        self.steps = 0
        self.stall_ms: list[float] = []
        self.train_ms: list[float] = []
        self.commit_ms: list[float] = []
        self.rows: list[dict] = []  # one per report point
        self._stall: list[float] = []  # this rank's, since the last report point
        self._train: list[float] = []

    @property
    def done(self) -> int:
        return len(self.stall_ms) + len(self._stall)

    def run(self, count: int) -> None:
        """``count`` more intervals of training, each followed by a save that is not waited for."""
        a = self.args
        for _ in range(count):
            t0 = time.perf_counter()
            for _ in range(a.steps_per_interval):
                step(self.dmp, self.opt, zipf_batch(self.specs, a.batch_size, a.pooling, self.gen))
                self.steps += 1
            t1 = time.perf_counter()
            handle = self.ck.save(self.steps)
            t2 = time.perf_counter()
            self.clock.watch(t1, handle)
            self._train.append((t1 - t0) * 1e3)
            self._stall.append((t2 - t1) * 1e3)

    def settle(self) -> None:
        """Waits for the save and the compaction in flight on every rank, and keeps the slowest rank's figures."""
        try:
            self.ck.wait(compaction=True)
        except Exception:  # noqa: BLE001 - the clock has recorded the failed save
            pass
        self.clock.drain()
        n = len(self._stall)
        block = torch.tensor([self._stall, self._train, self.clock.ms[-n:]], dtype=torch.float64)
        dist.all_reduce(block, op=dist.ReduceOp.MAX)
        self.stall_ms += block[0].tolist()
        self.train_ms += block[1].tolist()
        self.commit_ms += block[2].tolist()
        self._stall, self._train = [], []
        dist.barrier()


def disk_state(job: Job) -> dict:
    """What lies under the job's root (rank 0, which sees all of it): bytes, and the newest chain."""
    infos = job.ck.list()
    newest = max(infos, key=lambda i: (i.step, i.id))
    path = lambda i: os.path.join(job.root, ckpt_dir(i))  # noqa: E731
    return {
        "stored_bytes": dir_bytes(job.root), "chain": len(newest.chain), "newest_id": newest.id,
        "newest_step": newest.step, "checkpoints_on_disk": len(infos),
        "compactions_started": newest.id + 1 - job.done,  # each one takes an id of its own
        "chain_baseline_bytes": dir_bytes(path(newest.chain[0])),
        "chain_delta_bytes": sum(dir_bytes(path(i)) for i in newest.chain[1:]),
    }


def restore_newest(job: Job) -> tuple[float, int]:
    """(ms, step) of a restore of the job's newest checkpoint by a fresh model and Checkpointer."""
    dmp, opt = build(job.specs, dist.get_world_size())
    ck = Checkpointer(dmp, job.config, dense_optimizer=opt)
    got = {}
    try:
        ms = timed(lambda: got.setdefault("step", ck.restore()))
    finally:
        ck.close()
    del ck, dmp, opt
    gc.collect()
    return ms, got["step"]


def report(job: Job, start: int) -> dict:
    """The job's row at a report point: figures of checkpoints ``start+1..done``, the root, and a restore."""
    state = [disk_state(job) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(state, src=0)
    ms, restored = restore_newest(job)
    row = {"checkpoint": job.done, "step": job.steps, **state[0], "restore_ms": ms, "restored_step": restored,
           "commit_ms": statistics.median(job.commit_ms[start:]), "stall_ms": statistics.median(job.stall_ms[start:]),
           "train_ms": statistics.median(job.train_ms[start:])}
    if restored != job.steps:
        print(f"rank {dist.get_rank()}: {job.name}: restore returned step {restored}, the newest is {job.steps}",
              flush=True)
    job.rows.append(row)
    return row


HEAD = f"{'commit ms':>10s}{'stall ms':>9s}{'train ms':>9s}{'stored MB':>11s}{'restore ms':>11s}{'chain':>6s}"


def fmt_row(r: dict) -> str:
    return (f"{r['commit_ms']:>10.1f}{r['stall_ms']:>9.1f}{r['train_ms']:>9.1f}{r['stored_bytes'] / 1e6:>11.2f}"
            f"{r['restore_ms']:>11.1f}{r['chain']:>6d}")


def figures(job: Job, plain: Job, window: int) -> dict:
    """The JSON figures of ``job``; stall ratio against ``plain``."""
    ok = lambda xs: [x for x in xs if x >= 0]  # noqa: E731 - failed saves are -1
    stall, plain_stall = statistics.median(job.stall_ms), statistics.median(plain.stall_ms)
    first, last = job.rows[0], job.rows[-1]
    baseline = first["chain_baseline_bytes"]  # the first baseline, while the first chain stands
    return {
        "commit_ms_first50": statistics.median(ok(job.commit_ms[:window])),
        "commit_ms_last50": statistics.median(ok(job.commit_ms[-window:])),
        "stored_over_baseline_last": last["stored_bytes"] / baseline,
        "restore_ms_10": next(r["restore_ms"] for r in job.rows if r["checkpoint"] == min(10, job.done)),
        f"restore_ms_{job.done}": last["restore_ms"],
        "stall_ratio_compaction_vs_plain": stall / plain_stall,
        "median_stall_ms": stall, "median_train_ms": statistics.median(job.train_ms),
        "baseline_bytes": baseline, "stored_bytes_last": last["stored_bytes"],
        "chain_delta_bytes_last": last["chain_delta_bytes"], "compactions_started": last["compactions_started"],
        "window": window,
        "failed_saves": job.clock.errors, "rows": job.rows,
        "commit_ms_all": job.commit_ms, "stall_ms_all": job.stall_ms,
    }


def targets(f: dict, n: int) -> dict:
    """The soak's targets on the compaction job's figures ``f``: value, limit, pass."""
    bound = 2 * f["baseline_bytes"] + f["chain_delta_bytes_last"]
    rows = {
        "commit_last50_over_first50": (f["commit_ms_last50"] / f["commit_ms_first50"], 1.2),
        "stored_bytes_last": (f["stored_bytes_last"], bound),
        f"restore_ms_{n}_over_restore_ms_10": (f[f"restore_ms_{n}"] / f["restore_ms_10"], 1.2),
        "stall_ratio_compaction_vs_plain": (f["stall_ratio_compaction_vs_plain"], 1.1),
    }
    return {k: {"value": v, "limit": f"<= {lim:g}" if isinstance(lim, float) else f"<= {lim}", "pass": v <= lim}
            for k, (v, lim) in rows.items()}


def report_points(n: int, every: int) -> list[int]:
    return sorted({m for m in (10, *range(every, n + 1, every), n) if 1 <= m <= n})


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=int, default=500)
    p.add_argument("--rows", type=int, default=200_000, help="rows per table")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--steps-per-interval", type=int, default=4, help="training steps between saves")
    p.add_argument("--max-chain", type=int, default=16, help="compaction.max_chain of the compaction job")
    p.add_argument("--residual", action="store_true",
                   help="the compaction job codes residuals (quantization.residual: true); the plain job does not")
    p.add_argument("--every", type=int, default=50, help="checkpoints between report points")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given")
    p.add_argument("--out-dir", type=str, default="/tmp/cnr_bench_soak", help="scratch (wiped at start and end)")
    p.add_argument("--keep", action="store_true", help="leave the roots in --out-dir")
    p.add_argument("--log-level", type=str, default="WARNING", help="level of cnr_torchrec's log")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    if args.quick:
        given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    return args


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("cnr_torchrec").setLevel(args.log_level.upper())
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    specs = [TableSpec(f"t{i}", args.rows, args.dim, "row_wise" if i % 2 == 0 else "table_wise")
             for i in range(args.tables)]
    fresh_dir(args.out_dir, rank)
    jobs = [Job(name, specs, args, fresh_dir(os.path.join(args.out_dir, name), rank), compaction=name != "plain")
            for name in ("compaction", "plain")]
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, {args.tables} tables x {args.rows} rows x {args.dim}, batch "
              f"{args.batch_size}/rank, {args.steps_per_interval} steps per interval, {args.checkpoints} checkpoints; "
              f"compaction max_chain {args.max_chain}{' with residual coding' if args.residual else ''}, keep 1\n")
        print(f"{'':6s}{'--- compaction ':-<56s}  {'--- plain ':-<56s}\n{'ckpt':>6s}{HEAD}  {HEAD}", flush=True)
    for point in report_points(args.checkpoints, args.every):
        rows = []
        for job in jobs:
            start = job.done
            job.run(point - start)
            job.settle()
            rows.append(report(job, start))
        if rank == 0:
            print(f"{point:>6d}{fmt_row(rows[0])}  {fmt_row(rows[1])}", flush=True)
    for job in jobs:
        job.ck.close()
    window = min(50, args.checkpoints // 2)
    comp, plain = jobs
    out = {**figures(comp, plain, window), "plain": figures(plain, plain, window)}
    out["targets"] = targets(out, args.checkpoints)
    out["wall_s"] = slowest(time.perf_counter() - t_start)
    out["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "keep", "log_level")} | {
        "world_size": dist.get_world_size()}
    if rank == 0:
        print_summary(out, args.checkpoints)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    finish(args.out_dir, args.keep, rank)


def print_summary(out: dict, n: int) -> None:
    keys = ["commit_ms_first50", "commit_ms_last50", "stored_over_baseline_last", "restore_ms_10", f"restore_ms_{n}",
            "median_stall_ms", "median_train_ms", "stall_ratio_compaction_vs_plain"]
    print(f"\n{'':34s}{'compaction':>12s}{'plain':>12s}")
    for k in keys:
        print(f"{k:<34s}{out[k]:>12.2f}{out['plain'][k]:>12.2f}")
    print(f"(commit medians over the first and last {out['window']} checkpoints; one baseline = "
          f"{out['baseline_bytes']:,d} bytes; compactions started: {out['compactions_started']}; failed saves: "
          f"{len(out['failed_saves'])} / {len(out['plain']['failed_saves'])})")
    print("\ntargets (compaction job):")
    for k, t in out["targets"].items():
        shown = f"{t['value']:,.0f}" if t['value'] > 1e3 else f"{t['value']:.3f}"
        print(f"  {k:<40s}{shown:>16s}  {t['limit']:<16s}{'pass' if t['pass'] else 'FAIL'}")
    print(f"wall time {out['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
