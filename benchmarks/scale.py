"""Scaling: Checkpointer (consecutive, adaptive 4-bit) over model sizes and dirty fractions, against DCP and torchsnapshot.

Run on 2 ranks:  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/scale.py [--json PATH]
On GPUs:         torchrun --standalone --nproc_per_node N benchmarks/scale.py --device cuda (NCCL beside gloo,
                 which DCP's async_save needs; the model on cuda:LOCAL_RANK; docs/gpu.md has one H200's figures)
Quick run:       ... benchmarks/scale.py --sizes 1 --dirty 0.01,0.27   (31 s wall on the 2-core dev VM;
                 --sizes 10 with the default dirty fractions: 2 minutes)
Beside a peer:   ... benchmarks/scale.py --sizes 10,25 --dirty 0.27 --peer '{"quantization": {"residual": false}}'
                 runs each cell again with those keys over --config and prints both restores against the
                 same DCP load (the default config beside a plain chain)
Checkpoints go under --out-dir (default /tmp/cnr_bench_scale), one directory per cell, deleted
when the cell is done (and the whole directory at the end unless --keep).

Model. The reference model of benchmarks/checkpoint.py (whose helpers this file imports): 8 tables x
32 dim, half row_wise and half table_wise, EXACT_ROWWISE_ADAGRAD, a dense tower, gloo on CPU, with
200k rows per table times the size multiple (``--sizes``, default 1,10,25). One size multiple is
8 x 200k x (32 x 4 bytes of fp32 weights + 4 bytes of row-wise Adagrad state) = 211 MB, so 25x is
5.28 GB (4.92 GiB) of tables plus optimizer state over both ranks. One model is built per size and
used for every dirty fraction of that size; it is freed before the next size.

Checkpointer config: ``--config`` (default configs/consecutive.yaml: policy consecutive, adaptive
4-bit, float16 row bias, bfloat16 optimizer row state) with root set to the cell's directory,
``compaction: null`` (so that a restore replays exactly the baseline and every delta, instead of a
compacted baseline) and ``on_busy: wait`` (no save is ever dropped). ``--chunk-bytes`` and
``--io-threads`` are passed as the top-level keys ``chunk_bytes`` and ``io_threads`` only if
CheckpointConfig has such fields (checked with dataclasses.fields); otherwise they are reported
as ignored.

Dirty fraction (``--dirty``, default 0.01,0.1,0.27). Before each save, ``--steps-per-interval``
training steps run on batches whose ids are drawn from a fixed set of rows per table: a random
subset of round(fraction x rows) rows, the same on every rank, new for every interval. The ids of
the interval (both ranks, all steps) walk that set in turn, so every row of it is looked up at
least once and no other row is: exactly that share of each table is dirty. The pooling is the
smallest (not below ``--min-pooling``) that lets ``world x steps x batch x pooling`` ids cover the
set. "real dirty" is what the checkpoints say: rows_written of each delta (CheckpointInfo, summed
over the ranks) / all rows of all tables, the median over the deltas.

Warm-up: after building each size's model, ``--warmup-saves`` (default 1) baselines go to a
scratch root and are not measured (their figures are in the JSON under warmup_saves). The first
use of fresh memory is slow on this VM (the host backs guest pages on first touch: filling 2.5 GB
took 5.6 s the first time, 0.3 s the next), and without the warm-up the first cell's baseline at
10x stalled 5.6 s instead of 0.8-0.9 s in the other cells.

A cell (one size, one dirty fraction), with a new Checkpointer on a fresh root:
one interval of training, the baseline, then ``--deltas`` (default 10) times: one interval of
training and a delta. Every save is waited for (handle.wait()) before training goes on, so each
figure below is of that save alone, with no training beside it; in particular the first delta is
taken one training interval after the baseline's write finished.
  bytes: CheckpointInfo.nbytes (every rank's payload files); for deltas, the median.
  stall ms: CheckpointInfo.stall_ms, the slowest rank's time inside save() (collective decision,
      copy of the rows to host). The slowest rank's wall time of save() is in the JSON (stall_wall_ms).
  background ms: CheckpointInfo.write_ms, the slowest rank's encode + write time on the save
      thread. The wall time from save() to handle.wait() returning (commit included) is in the
      JSON (commit_wall_ms).
  peak extra MB: per rank, the highest RSS while the save runs (from the save() call until
      handle.wait() returns) minus the RSS just before save() (taken after gc.collect() and
      malloc_trim(0)). The highest RSS is VmHWM of /proc/self/status, reset by writing "5" to
      /proc/self/clear_refs before save(); where that reset is refused, the highest VmRSS seen by a
      thread that reads /proc/self/status every 2 ms instead. Memory that the allocator hands out
      again without growing RSS does not count.
  staged MB: per rank, the bytes of every tensor in what the save copied to host memory (the
      Staged object that cnr_torchrec.ckpt.checkpointer.stage returns; this file wraps that
      function to count them, and reports n/a if it is not there). "peak/staged" is the ratio of
      both, on the same rank (the largest over the ranks).
  wait ms: the first delta's stall minus the median stall of the other deltas (0 if below).
  restore warm / cold ms: a new Checkpointer restores the newest checkpoint (the baseline and
      every delta of the cell), the slowest rank's time of restore() from a barrier; median of
      ``--reps`` rounds of [evict, restore (cold), restore again (warm)]. A rank decodes on its share
      of the cores (config restore_threads; 1 under torchrun with 2 ranks on 2 cores); where that is
      more than one, each round also restores warm on one thread, and the JSON has both.
Eviction (cold): rank 0 calls os.sync(), then os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
on every file under the directory, and counts the file pages still in the page cache before and
after with mincore(2) (via ctypes); both counts are printed. The host of this VM may still cache
the disk beneath it, which no guest call can evict: a "cold" read may be faster than a real disk.

Peers, once per size, on the model state after its last cell (that cell's checkpoints restored):
  torchsnapshot: Snapshot.take(path, {"model": dmp}) (blocking), or, if that fails, LocalShards
      of benchmarks/checkpoint.py (each rank's shards and dense parameters as plain tensors).
  DCP save: torch.distributed.checkpoint.save({"model": dmp.state_dict()}) (blocking).
  DCP async_save blocking: the time until dcp.async_save(...) returns (the slowest rank's, from a
      barrier); then its future is waited for (total ms, also reported, with the peak extra RSS
      of the whole async save). In torch 2.13 DCP's default stager (DefaultStager, what async_save
      builds when given none) fails on TorchRec's ShardedTensors: it calls data_ptr() on them
      (RuntimeError "torch function 'data_ptr' ... not supported for ShardedTensor!"). With
      ``--dcp-stager auto`` the default is tried first and, if it fails, two stagers that work are
      both measured: DCP's own BlockingAsyncStager (a new host copy of each local shard, by
      _create_cpu_state_dict/_copy_state_dict) and ShardCopyStager of this file (a plain host copy
      of each local shard and tensor; pinned memory needs CUDA, and shared memory only helps the
      process executor, so neither is used). The targets take the one that blocks less (the
      stricter peer); both, and the default's error, are printed.
  DCP load: dcp.load({"model": dmp.state_dict()}) from the DCP save, in ``--reps`` rounds of
      [evict, load (cold), load (warm)].
Peers' times are medians of ``--reps`` and the slowest rank's; bytes are every file of the output.

Targets (at the largest size; each with its value, limit and pass/fail; a ratio's limit is the
factor shown):
  baseline_stall: the largest baseline stall of the size's cells <= 1.0 x DCP async_save blocking.
  delta_stall_high / _low: median delta stall of the cell with the highest / lowest dirty fraction
      (0.27 / 0.01 by default) <= 0.5x / 0.1x async_save blocking.
  restore_cold / _warm: the largest median restore of the size's cells <= 0.3x DCP load cold /
      warm (issue 28; warm was 0.5x before).
  restore_peak_memory: the largest peak extra RSS during a warm restore over a rank's shard bytes
      (weights and fused optimizer state) <= 1.25; mapped chunk files count, as RSS counts them.
  restore_bytes_over_minimal: at the highest dirty fraction, the bytes a warm restore reads (all
      ranks) / the stored bytes of the rows it applies, each from the newest checkpoint that holds
      it (Checkpointer.last_restore_stats' bytes_read / minimal_bytes) <= 1.15.
  delta_bytes_low / delta_background_low: at the lowest dirty fraction, median delta bytes / the
      baseline's bytes, and median delta background ms / the baseline's, each <= 0.03.
  peak_memory: the largest peak extra / staged bytes over the ranks and the size's baselines <=
      1.25 (deltas' ratios, whose staged bytes are small beside the fixed costs, are in the JSON).
  no_wait: the first delta's stall <= 1.5 x the median stall of the other deltas + 5 ms, in every
      cell of the size (the worst is shown, with its wait).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import statistics
import sys
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cnr_torchrec import Checkpointer, load_config
from cnr_torchrec.ckpt.config import CheckpointConfig, CompactionConfig
from cnr_torchrec.ckpt.restore.threads import decode_threads

# The repository root, for the example job and models (cnr_dlrm, examples), which are not in the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.toy import TableSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dist import add_device_argument, init_process_group  # noqa: E402
from checkpoint import (  # noqa: E402
    LocalShards,
    breakdown_line,
    build,
    dir_bytes,
    finish,
    fresh_dir,
    median_breakdown,
    restore_ms,
    slowest,
    step,
    timed,
    total,
)

REF_ROWS, TABLES, DIM = 200_000, 8, 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVICTION = "os.sync() + os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) on every file; checked with mincore(2)"
T0 = time.perf_counter()


def progress(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def gather(value: float) -> list[float]:
    """``value`` of every rank, by rank."""
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------- host memory

_LIBC = ctypes.CDLL(None, use_errno=True)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss() -> int:
    return _status_kb("VmRSS") * 1024


def settle_memory() -> None:
    """Frees what can be freed, so that the RSS before a save is not inflated by garbage."""
    gc.collect()
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:  # not glibc
        pass


class PeakRSS:
    """Highest RSS of this process while in the ``with`` block, minus the RSS at its start."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s

    def __enter__(self) -> PeakRSS:
        self.start = rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.sampled = self.start
        self._stop = threading.Event()
        self._thread = None
        if not self.hwm_reset:  # VmHWM is exact once reset; the sampler (which takes the GIL) is the fallback
            self._thread = threading.Thread(target=self._loop, name="scale-rss", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sampled = max(self.sampled, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sampled = max(self.sampled, rss())
        self.peak = max(self.sampled, _status_kb("VmHWM") * 1024 if self.hwm_reset else 0)
        self.extra = self.peak - self.start


def tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` (dataclasses, dicts, lists, tuples)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return st.nbytes()
    if id(obj) in seen:
        return 0
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        seen.add(id(obj))
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        seen.add(id(obj))
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        seen.add(id(obj))
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


class StagedBytes:
    """Counts the bytes that Checkpointer.save() copies to host, by wrapping the checkpointer module's ``stage``."""

    def __init__(self) -> None:
        import cnr_torchrec.ckpt.checkpointer as mod

        self.nbytes = 0
        orig = getattr(mod, "stage", None)
        self.available = callable(orig)
        if not self.available:
            return

        def counted(*args, **kwargs):
            out = orig(*args, **kwargs)
            self.nbytes += tensor_bytes(out)
            return out

        mod.stage = counted

    def take(self) -> int | None:
        n, self.nbytes = self.nbytes, 0
        return n if self.available else None


# ---------------------------------------------------------------- page cache

_PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def resident(paths: list[str]) -> tuple[int, int] | None:
    """(pages in the page cache, pages) of ``paths``, by mincore(2); None if it cannot be asked."""
    cached = pages = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        n = (size + _PAGE - 1) // _PAGE
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _LIBC.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, _MAP_FAILED):
                return None
            try:
                vec = (ctypes.c_ubyte * n)()
                if _LIBC.mincore(addr, size, vec) != 0:
                    return None
                cached += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
            finally:
                _LIBC.munmap(addr, size)
        finally:
            os.close(fd)
        pages += n
    return cached, pages


def evict(root: str) -> dict:
    """Drops ``root``'s files from the page cache (rank 0 for all ranks); every rank returns the report."""
    rep = {}
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
        paths = files_under(root)
        before = resident(paths)
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        after = resident(paths)
        rep = {"method": EVICTION, "files": len(paths),
               "resident_before": None if before is None else before[0] / max(before[1], 1),
               "resident_after": None if after is None else after[0] / max(after[1], 1)}
    dist.barrier()
    return rep


def eviction_summary(reports: list[dict]) -> dict:
    reps = [r for r in reports if r]
    if not reps:
        return {}
    after = [r["resident_after"] for r in reps]
    return {"method": EVICTION, "rounds": len(reps),
            "resident_before_max": max((r["resident_before"] for r in reps if r["resident_before"] is not None),
                                       default=None),
            "resident_after_max": None if None in after else max(after),
            "verified": None if None in after else max(after) < 0.01}


# ---------------------------------------------------------------- workload

def pooling_for(rows: int, frac: float, args, world: int) -> int:
    need = max(1, round(frac * rows))
    return max(args.min_pooling, math.ceil(need / (world * args.steps_per_interval * args.batch_size)))


def train_interval(dmp, opt, specs, frac: float, interval: int, pooling: int, args, rank: int, world: int) -> None:
    """``--steps-per-interval`` steps whose ids, over both ranks, look up exactly round(frac x rows) rows per table."""
    chosen = []
    for i, s in enumerate(specs):
        g = torch.Generator().manual_seed(args.seed + 7919 * interval + 104729 * i)  # the same on every rank
        chosen.append(torch.randperm(s.rows, generator=g)[: max(1, round(frac * s.rows))])
    per = args.batch_size * pooling
    for st in range(args.steps_per_interval):
        start = (st * world + rank) * per  # rank r, step s: its slice of the interval's walk over the set
        pos = torch.arange(start, start + per)
        values = torch.cat([c[pos % c.numel()] for c in chosen])
        lengths = torch.full((len(specs) * args.batch_size,), pooling, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[s.feature for s in specs], values=values, lengths=lengths)
        step(dmp, opt, kjt.to(dmp.device))


def make_config(root: str, args, notes: dict, compaction: dict | None = None):
    over = {**(args.overrides or {}), "root": root, "on_busy": "wait", "compaction": compaction}
    fields = {f.name for f in dataclasses.fields(CheckpointConfig)}
    for key, value in (("chunk_bytes", args.chunk_bytes), ("io_threads", args.io_threads)):
        if value is None:
            continue
        if key in fields:
            over[key] = value
            notes[key] = f"passed: {value}"
        else:
            notes[key] = f"ignored ({value}): CheckpointConfig has no field {key!r}"
    return load_config(args.config, **over)


# ---------------------------------------------------------------- one cell

def measured_save(ck, step_no: int, staged: StagedBytes) -> dict:
    settle_memory()
    dist.barrier()
    staged.take()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        handle = ck.save(step_no)
        t1 = time.perf_counter()
        info = handle.wait()
        t2 = time.perf_counter()
    sb = staged.take()
    extra, sbytes = gather(mem.extra), gather(-1 if sb is None else sb)
    return {
        "id": info.id, "kind": info.kind, "step": info.step, "nbytes": info.nbytes, "rows_written": info.rows_written,
        "chain_length": len(info.chain), "stall_ms": info.stall_ms, "write_ms": info.write_ms,
        "stall_wall_ms": slowest((t1 - t0) * 1e3), "commit_wall_ms": slowest((t2 - t0) * 1e3),
        "peak_extra_bytes": [int(x) for x in extra],
        "staged_bytes": None if sb is None else [int(x) for x in sbytes],
        "peak_rss_reset": bool(total(int(not mem.hwm_reset)) == 0),
    }


def shard_bytes(dmp) -> int:
    """Bytes of this rank's table shards and their fused optimizer states: what a restore fills."""
    tracker, out = dmp.dirty_tracker, 0
    for t in tracker.tables():
        for kernel, shard in tracker.shards(t):
            out += kernel.tbe.split_embedding_weights()[shard.local_index].nbytes
            states = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
            out += sum(st.nbytes for st in (states[shard.local_index] if states else []))
    return out


def restore_peak_over_shards(dmp, opt, config) -> float:
    """One more warm restore: the largest rank's peak extra RSS during it / that rank's shard bytes (mapped
    chunk files count, as RSS counts them)."""
    settle_memory()
    dist.barrier()
    with PeakRSS() as mem:
        restore_ms(dmp, opt, config)
    return max(e / b for e, b in zip(gather(mem.extra), gather(shard_bytes(dmp))) if b > 0)


def peak_ratio(save: dict) -> float | None:
    if save["staged_bytes"] is None:
        return None
    return max(e / s for e, s in zip(save["peak_extra_bytes"], save["staged_bytes"]) if s > 0)


def warm_up(dmp, opt, specs, size: float, args, rank: int, world: int, staged: StagedBytes, notes: dict) -> list:
    """``--warmup-saves`` unmeasured baselines (one interval of training each) into a scratch root.

    The first use of fresh memory is slow on this VM (its host backs guest pages on first touch:
    2.5 GB took 5.6 s to fill the first time, 0.3 s the next), and the first save also pays
    one-time costs in the library; neither belongs to a steady-state save.
    """
    out = []
    for w in range(args.warmup_saves):
        root = fresh_dir(os.path.join(args.out_dir, f"x{size:g}_warmup"), rank)
        ck = Checkpointer(dmp, make_config(root, args, notes), dense_optimizer=opt)
        try:
            frac = args.dirty[0]
            train_interval(dmp, opt, specs, frac, 10_000 + w, pooling_for(specs[0].rows, frac, args, world),
                           args, rank, world)
            rec = measured_save(ck, 0, staged)
        finally:
            ck.close()
        out.append({k: rec[k] for k in ("kind", "nbytes", "stall_ms", "write_ms", "peak_extra_bytes")})
        progress(f"  x{size:g} warm-up save: stall {rec['stall_ms']:.0f} ms, background {rec['write_ms']:.0f} ms")
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    return out


def run_cell(dmp, opt, specs, size: float, frac: float, args, rank: int, world: int, staged: StagedBytes,
             notes: dict) -> dict:
    root = fresh_dir(os.path.join(args.out_dir, f"x{size:g}_d{frac:g}"), rank)
    config = make_config(root, args, notes)
    pooling = pooling_for(specs[0].rows, frac, args, world)
    all_rows = sum(s.rows for s in specs)
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    saves, tracked = [], []
    n_step = 0
    try:
        for k in range(args.deltas + 1):
            train_interval(dmp, opt, specs, frac, k, pooling, args, rank, world)
            n_step += args.steps_per_interval
            tracked.append(total(sum(dmp.dirty_tracker.dirty_counts().values())) / all_rows)
            saves.append(measured_save(ck, n_step, staged))
            progress(f"  x{size:g} dirty {frac:g}: {saves[-1]['kind']} {saves[-1]['id']}, "
                     f"{saves[-1]['nbytes']:,d} B, stall {saves[-1]['stall_ms']:.1f} ms")
    finally:
        ck.close()
    base, deltas = saves[0], saves[1:]
    if base["kind"] != "baseline" or any(d["kind"] != "delta" for d in deltas):
        raise RuntimeError(f"expected a baseline then deltas, got {[s['kind'] for s in saves]}")

    cold, warm, ev, found, one_thread = [], [], [], [], []
    threads = decode_threads(config.restore_threads)
    for _ in range(args.reps):
        ev.append(evict(root))
        cold.append(restore_ms(dmp, opt, config))
        warm.append(restore_ms(dmp, opt, config, found))
        if threads > 1:  # the peer: the same warm restore decoding on one thread, as a rank of torchrun runs
            one_thread.append(restore_ms(dmp, opt, dataclasses.replace(config, restore_threads=1)))
    breakdown = median_breakdown(found)
    restore_peak = restore_peak_over_shards(dmp, opt, config)
    progress(f"  x{size:g} dirty {frac:g}: restore cold {statistics.median(cold):.0f} ms, "
             f"warm {statistics.median(warm):.0f} ms on {threads} decode thread(s)"
             + (f" ({statistics.median(one_thread):.0f} ms on 1)" if one_thread else ""))
    if rank == 0 and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()

    med = statistics.median
    others = [d["stall_ms"] for d in deltas[1:]] or [deltas[0]["stall_ms"]]
    first, others_med = deltas[0]["stall_ms"], med(others)
    ratios = [peak_ratio(d) for d in deltas]
    return {
        "size": size, "rows_per_table": specs[0].rows, "dirty_target": frac, "pooling": pooling,
        "steps_per_interval": args.steps_per_interval,
        "dirty_real": med(d["rows_written"] for d in deltas) / all_rows,
        "dirty_tracked": med(tracked[1:]),
        "baseline": base, "deltas": deltas,
        "baseline_bytes": base["nbytes"], "delta_bytes": med(d["nbytes"] for d in deltas),
        "baseline_stall_ms": base["stall_ms"], "delta_stall_ms": med(d["stall_ms"] for d in deltas),
        "baseline_write_ms": base["write_ms"], "delta_write_ms": med(d["write_ms"] for d in deltas),
        "baseline_peak_extra_bytes": max(base["peak_extra_bytes"]),
        "baseline_staged_bytes": None if base["staged_bytes"] is None else max(base["staged_bytes"]),
        "baseline_peak_over_staged": peak_ratio(base),
        "delta_peak_over_staged_max": None if None in ratios else max(ratios),
        "first_delta_stall_ms": first, "other_deltas_stall_ms": others_med,
        "first_delta_wait_ms": max(0.0, first - others_med),
        "chain_length": deltas[-1]["chain_length"],
        "restore_cold_ms": med(cold), "restore_warm_ms": med(warm),
        "restore_cold_ms_all": cold, "restore_warm_ms_all": warm, "restore_threads": threads,
        "restore_warm_one_thread_ms": med(one_thread) if one_thread else None,
        "restore_breakdown": breakdown, "restore_peak_over_shards": restore_peak,
        "restore_bytes_over_minimal": breakdown["bytes_read"] / breakdown["minimal_bytes"]
        if breakdown["minimal_bytes"] else None,
        "eviction": eviction_summary(ev),
    }


def run_compaction_cycle(dmp, opt, specs, size: float, frac: float, args, rank: int, world: int, staged: StagedBytes,
                         notes: dict) -> dict:
    """A cell with ``compaction: {max_chain: args.compaction_cycle}``, over a full compaction cycle: the chain
    grows to the trigger, the background merge runs, the next delta hangs on the compacted baseline, and
    deltas go on. After each save (and the compaction it started), a new Checkpointer restores the newest
    checkpoint, warm; the cell reports every restore and the worst."""
    max_chain = args.compaction_cycle
    root = fresh_dir(os.path.join(args.out_dir, f"x{size:g}_d{frac:g}_compaction"), rank)
    config = make_config(root, args, notes, compaction=CompactionConfig(max_chain=max_chain))  # the section whole
    pooling = pooling_for(specs[0].rows, frac, args, world)
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    restores, found, n_step = [], [], 0
    try:
        for k in range(max_chain + 5):  # the trigger, the merge, the fold, and deltas on the compacted baseline
            train_interval(dmp, opt, specs, frac, 1000 + k, pooling, args, rank, world)
            n_step += args.steps_per_interval
            save = measured_save(ck, n_step, staged)
            ck.wait(compaction=True)  # a merge it started is on storage before the restore looks
            ms = restore_ms(dmp, opt, config, found)
            restores.append({"id": save["id"], "kind": save["kind"], "chain_length": save["chain_length"],
                             "restore_warm_ms": ms})
            progress(f"  x{size:g} compaction cycle: {save['kind']} {save['id']} (chain of {save['chain_length']}), "
                     f"restore {ms:.0f} ms")
    finally:
        ck.close()
    if rank == 0 and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    worst = max(range(len(restores)), key=lambda i: restores[i]["restore_warm_ms"])
    return {"size": size, "dirty_target": frac, "max_chain": max_chain, "restores": restores,
            "worst_restore_warm_ms": restores[worst]["restore_warm_ms"], "worst_breakdown": found[worst],
            "compacted": any(r["chain_length"] < restores[i - 1]["chain_length"] for i, r in enumerate(restores)
                             if i)}


# ---------------------------------------------------------------- peers

class ShardCopyStager:
    """A DCP AsyncStager that copies every tensor, and each local shard of a ShardedTensor, into new host memory."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        return self._copy(state_dict)

    def _copy(self, obj):
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        if isinstance(obj, ShardedTensor):
            # The copies live in host memory, so their metadata says so: ShardedTensor checks each
            # shard's device against its placement (cuda:N for the shards of a CUDA model).
            shards = [Shard(s.tensor.detach().to("cpu", copy=True), _on_host(s.metadata)) for s in obj.local_shards()]
            meta = obj.metadata()
            meta = dataclasses.replace(meta, shards_metadata=[_on_host(m) for m in meta.shards_metadata])
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, meta, process_group=obj._process_group)
        if isinstance(obj, torch.Tensor):
            return obj.detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v) for v in obj)
        return obj

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _on_host(md):
    """A copy of ShardMetadata ``md`` placed on the CPU of the same rank."""
    from torch.distributed.remote_device import _remote_device

    return dataclasses.replace(md, placement=_remote_device(f"rank:{md.placement.rank()}/cpu"))


def make_stager(kind: str):
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return {"default": lambda: None, "blocking": BlockingAsyncStager, "shards": ShardCopyStager}[kind]()


STAGER_NAMES = {"default": "DCP default (DefaultStager)", "blocking": "DCP BlockingAsyncStager",
                "shards": "ShardCopyStager (this file)"}


def short(text: str, head: int = 90, tail: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= head + tail + 5 else f"{text[:head]} ... {text[-tail:]}"


def async_save_once(dmp, path: str, kind: str):
    """One dcp.async_save with stager ``kind``: (blocking ms, total ms, peak extra bytes) or the error (every rank)."""
    import torch.distributed.checkpoint as dcp

    settle_memory()
    dist.barrier()
    err = ""
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        try:
            fut = dcp.async_save({"model": dmp.state_dict()}, checkpoint_id=path, async_stager=make_stager(kind))
        except Exception as e:  # noqa: BLE001 - reported, and the next stager is tried
            err = f"{type(e).__name__}: {short(str(e))}"
        t1 = time.perf_counter()
        if not err:
            fut.result()
        t2 = time.perf_counter()
    failed = total(int(bool(err)))
    if failed:
        if failed != dist.get_world_size():
            raise RuntimeError(f"dcp.async_save failed on {failed} of the ranks only: {err or 'not this one'}")
        return err
    return slowest((t1 - t0) * 1e3), slowest((t2 - t0) * 1e3), max(gather(mem.extra))


def peers(dmp, args, rank: int, size: float, stagers: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torchsnapshot import Snapshot

    med = statistics.median
    base = os.path.join(args.out_dir, f"x{size:g}_peers")
    fresh_dir(base, rank)
    res: dict = {}

    # torchsnapshot
    app_name, app = '{"model": dmp}', dmp
    takes, nbytes = [], None
    for r in range(args.reps):
        path = os.path.join(base, f"snapshot_{r}")
        settle_memory()
        try:
            takes.append(timed(lambda: Snapshot.take(path, {"model": app})))
        except Exception as e:  # noqa: BLE001 - the fallback of benchmarks/checkpoint.py
            if isinstance(app, LocalShards):
                raise
            res["torchsnapshot_error_with_dmp"] = f"{type(e).__name__}: {short(str(e))}"
            app_name, app = '{"model": LocalShards(dmp)}', LocalShards(dmp)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            takes.append(timed(lambda: Snapshot.take(path, {"model": app})))
        dist.barrier()
        if nbytes is None:
            nbytes = total(dir_bytes(path) if rank == 0 else 0)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    res["torchsnapshot"] = {"app_state": app_name, "take_ms": med(takes), "take_ms_all": takes, "nbytes": nbytes}
    progress(f"  x{size:g} peers: torchsnapshot take {med(takes):.0f} ms, {nbytes:,d} B")

    # DCP async_save (blocking part), each into its own directory, removed once its future is done.
    # auto: DCP's default stager if it works; otherwise both BlockingAsyncStager and ShardCopyStager,
    # and the targets take the one that blocks less (the stricter peer).
    errors = stagers.setdefault("errors", {})
    active = ["default", "blocking", "shards"] if args.dcp_stager == "auto" else [args.dcp_stager]
    active = [k for k in active if k not in errors]
    runs: dict[str, list] = {}
    for r in range(args.reps):
        for kind in list(active):
            path = os.path.join(base, f"dcp_async_{kind}_{r}")
            out = async_save_once(dmp, path, kind)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            if isinstance(out, str):
                errors[kind] = out
                active.remove(kind)
                progress(f"  dcp.async_save with {STAGER_NAMES[kind]} failed: {out}")
                continue
            runs.setdefault(kind, []).append(out)
            if kind == "default":
                active = ["default"]  # DCP's own default works: that is the peer
                break
        if not active:
            raise RuntimeError(f"dcp.async_save failed with every stager tried: {errors}")
    per = {STAGER_NAMES[k]: {"blocking_ms": med(o[0] for o in v), "blocking_ms_all": [o[0] for o in v],
                             "total_ms": med(o[1] for o in v), "total_ms_all": [o[1] for o in v],
                             "peak_extra_bytes_max": max(o[2] for o in v)} for k, v in runs.items()}
    best = min(per, key=lambda n: per[n]["blocking_ms"])
    res["dcp_async_save"] = {"stager": best, **per[best], "stagers": per,
                             "stager_errors": {STAGER_NAMES[k]: e for k, e in errors.items()}}
    progress(f"  x{size:g} peers: dcp.async_save blocking " + ", ".join(
        f"{per[n]['blocking_ms']:.0f} ms ({n})" for n in per))

    # DCP save (blocking); the last one is kept for the loads
    path = os.path.join(base, "dcp")
    saves = []
    for _ in range(args.reps):
        fresh_dir(path, rank)
        settle_memory()
        saves.append(timed(lambda: dcp.save({"model": dmp.state_dict()}, checkpoint_id=path)))
    res["dcp_save"] = {"save_ms": med(saves), "save_ms_all": saves,
                       "nbytes": total(dir_bytes(path) if rank == 0 else 0)}

    def load():
        dcp.load({"model": dmp.state_dict()}, checkpoint_id=path)

    cold, warm, ev = [], [], []
    for _ in range(args.reps):
        ev.append(evict(path))
        cold.append(timed(load))
        warm.append(timed(load))
    res["dcp_load"] = {"cold_ms": med(cold), "warm_ms": med(warm), "cold_ms_all": cold, "warm_ms_all": warm,
                       "eviction": eviction_summary(ev)}
    progress(f"  x{size:g} peers: dcp.save {med(saves):.0f} ms, load cold {med(cold):.0f} ms, "
             f"warm {med(warm):.0f} ms")
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    return res


# ---------------------------------------------------------------- targets and output

def targets(cells: list[dict], peer: dict, size: float) -> dict:
    mine = [c for c in cells if c["size"] == size]
    hi = max(mine, key=lambda c: c["dirty_target"])
    lo = min(mine, key=lambda c: c["dirty_target"])
    block = peer["dcp_async_save"]["blocking_ms"]
    load_cold, load_warm = peer["dcp_load"]["cold_ms"], peer["dcp_load"]["warm_ms"]
    out = {}

    def add(name, what, value_ms_or_ratio, ref, factor, extra=None):
        value = value_ms_or_ratio / ref if ref else None
        out[name] = {"what": what, "value": value, "limit": factor,
                     "pass": value is not None and value <= factor, **(extra or {})}

    base_stall = max(c["baseline_stall_ms"] for c in mine)
    add("baseline_stall", "largest baseline stall / DCP async_save blocking", base_stall, block, 1.0,
        {"stall_ms": base_stall, "async_blocking_ms": block})
    add("delta_stall_high", f"median delta stall at dirty {hi['dirty_target']:g} / async_save blocking",
        hi["delta_stall_ms"], block, 0.5, {"stall_ms": hi["delta_stall_ms"], "async_blocking_ms": block})
    add("delta_stall_low", f"median delta stall at dirty {lo['dirty_target']:g} / async_save blocking",
        lo["delta_stall_ms"], block, 0.1, {"stall_ms": lo["delta_stall_ms"], "async_blocking_ms": block})
    rc = max(c["restore_cold_ms"] for c in mine)
    rw = max(c["restore_warm_ms"] for c in mine)
    add("restore_cold", "largest restore (baseline + deltas), cold / DCP load cold", rc, load_cold, 0.3,
        {"restore_ms": rc, "dcp_load_ms": load_cold})
    add("restore_warm", "largest restore (baseline + deltas), warm / DCP load warm", rw, load_warm, 0.3,
        {"restore_ms": rw, "dcp_load_ms": load_warm})
    over = hi["restore_bytes_over_minimal"]
    peak = max(c["restore_peak_over_shards"] for c in mine)
    out["restore_peak_memory"] = {"what": "largest peak extra RSS during a warm restore / the rank's shard bytes "
                                          "(weights and optimizer state)", "value": peak, "limit": 1.25,
                                  "pass": peak <= 1.25}
    out["restore_bytes_over_minimal"] = {
        "what": f"bytes a warm restore reads / the stored bytes of the rows it applies, at dirty "
                f"{hi['dirty_target']:g}", "value": over, "limit": 1.15, "pass": over is not None and over <= 1.15,
        "bytes_read": hi["restore_breakdown"]["bytes_read"], "minimal_bytes": hi["restore_breakdown"]["minimal_bytes"]}
    add("delta_bytes_low", f"median delta bytes / baseline bytes at dirty {lo['dirty_target']:g}",
        lo["delta_bytes"], lo["baseline_bytes"], 0.03,
        {"delta_bytes": lo["delta_bytes"], "baseline_bytes": lo["baseline_bytes"]})
    add("delta_background_low", f"median delta background ms / baseline's at dirty {lo['dirty_target']:g}",
        lo["delta_write_ms"], lo["baseline_write_ms"], 0.03,
        {"delta_write_ms": lo["delta_write_ms"], "baseline_write_ms": lo["baseline_write_ms"]})
    ratios = [c["baseline_peak_over_staged"] for c in mine]
    worst = None if None in ratios else max(ratios)
    out["peak_memory"] = {"what": "largest peak extra RSS / staged bytes (per rank, baselines)", "value": worst,
                          "limit": 1.25, "pass": worst is not None and worst <= 1.25,
                          "delta_ratio_max": max((c["delta_peak_over_staged_max"] or 0.0) for c in mine)}
    waits = [(c["first_delta_stall_ms"] - (1.5 * c["other_deltas_stall_ms"] + 5.0), c) for c in mine]
    _, wc = max(waits, key=lambda w: w[0])
    limit = 1.5 * wc["other_deltas_stall_ms"] + 5.0
    out["no_wait"] = {"what": "first delta's stall (ms) after the baseline's write, limit 1.5 x other deltas' "
                              "median + 5 ms (worst cell)",
                      "value": wc["first_delta_stall_ms"], "limit": limit,
                      "pass": all(w <= 0 for w, _ in waits), "wait_ms": wc["first_delta_wait_ms"],
                      "dirty": wc["dirty_target"]}
    for v in out.values():
        v["size"] = size
    return out


def mb(n) -> str:
    return "n/a" if n is None else f"{n / 1e6:.1f}"


HEADER = (f"{'size':>5s}{'rows/tbl':>10s}{'dirty':>7s}{'real':>7s}{'base MB':>9s}{'delta MB':>9s}{'b.stall':>9s}"
          f"{'d.stall':>9s}{'b.bg ms':>9s}{'d.bg ms':>9s}{'peak+MB':>9s}{'stagedMB':>9s}{'pk/st':>7s}"
          f"{'rst warm':>9s}{'rst cold':>9s}{'wait ms':>8s}")


def side_by_side(size: float, cells: list[dict], peer: dict, args) -> str:
    """Each cell's restore under --config and with --peer's keys, over this size's DCP load (the same run)."""
    warm, cold = peer["dcp_load"]["warm_ms"], peer["dcp_load"]["cold_ms"]
    lines = [f"x{size:g} restores against DCP load (warm {warm:.0f} ms, cold {cold:.0f} ms), the same run:"]
    for c in cells:
        for name, cell in ((os.path.basename(args.config), c), (json.dumps(args.peer), c["peer_config"])):
            w, k = cell["restore_warm_ms"], cell["restore_cold_ms"]
            lines.append(f"  dirty {c['dirty_target']:g} {name:<40s} warm {w:7.0f} ms "
                         f"({w / warm:.2f}x), cold {k:7.0f} ms ({k / cold:.2f}x)")
    return "\n".join(lines)


def row(c: dict) -> str:
    r = c["baseline_peak_over_staged"]
    return (f"{c['size']:>5g}{c['rows_per_table']:>10,d}{c['dirty_target']:>7.1%}{c['dirty_real']:>7.1%}"
            f"{mb(c['baseline_bytes']):>9s}{mb(c['delta_bytes']):>9s}{c['baseline_stall_ms']:>9.1f}"
            f"{c['delta_stall_ms']:>9.1f}{c['baseline_write_ms']:>9.1f}{c['delta_write_ms']:>9.1f}"
            f"{mb(c['baseline_peak_extra_bytes']):>9s}{mb(c['baseline_staged_bytes']):>9s}"
            f"{'n/a' if r is None else format(r, '.2f'):>7s}{c['restore_warm_ms']:>9.0f}{c['restore_cold_ms']:>9.0f}"
            f"{c['first_delta_wait_ms']:>8.1f}")


def peer_line(size: float, p: dict) -> str:
    s, a, d, l = p["torchsnapshot"], p["dcp_async_save"], p["dcp_save"], p["dcp_load"]
    return (f"x{size:g}: torchsnapshot take {s['take_ms']:.0f} ms ({mb(s['nbytes'])} MB, {s['app_state']}); "
            f"DCP save {d['save_ms']:.0f} ms ({mb(d['nbytes'])} MB); DCP async_save blocking {a['blocking_ms']:.0f} ms, "
            f"total {a['total_ms']:.0f} ms, peak extra {mb(a['peak_extra_bytes_max'])} MB ({a['stager']}); "
            f"DCP load warm {l['warm_ms']:.0f} ms, cold {l['cold_ms']:.0f} ms")


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_floats, default=[1.0, 10.0, 25.0],
                        help="model sizes, as multiples of 200k rows per table (fractions allowed)")
    parser.add_argument("--dirty", type=parse_floats, default=[0.01, 0.1, 0.27],
                        help="share of each table's rows looked up between two saves")
    parser.add_argument("--deltas", type=int, default=10, help="deltas after the baseline, per cell")
    parser.add_argument("--compaction-cycle", type=int, default=8, metavar="MAX_CHAIN",
                        help="per size, a cell at the highest dirty fraction with compaction max_chain MAX_CHAIN, a "
                             "restore after every save over a full compaction cycle (0: none)")
    parser.add_argument("--steps-per-interval", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2048, help="per rank")
    parser.add_argument("--min-pooling", type=int, default=1, help="ids per sample at least (more if the set needs)")
    parser.add_argument("--reps", type=int, default=3, help="rounds of each restore, load and peer save")
    parser.add_argument("--config", type=str, default=os.path.join(REPO, "configs", "consecutive.yaml"))
    parser.add_argument("--peer", type=json.loads, default=None, metavar="JSON",
                        help="also run every cell under --config with these keys laid over it (load_config's "
                             "overrides; '{\"quantization\": {\"residual\": false}}' for a plain chain), right after "
                             "the cell itself, and print both restores side by side against the same DCP load")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="config chunk_bytes, if the config has it")
    parser.add_argument("--io-threads", type=int, default=None, help="config io_threads, if the config has it")
    parser.add_argument("--dcp-stager", choices=["auto", "default", "blocking", "shards"], default="auto",
                        help="stager of dcp.async_save; auto: the first of default, blocking, shards that works")
    parser.add_argument("--warmup-saves", type=int, default=1,
                        help="unmeasured baseline saves per size before its cells (0: none)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out-dir", type=str, default="/tmp/cnr_bench_scale")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoints in --out-dir")
    parser.add_argument("--log-level", type=str, default="WARNING", help="level of cnr_torchrec's log")
    parser.add_argument("--json", type=str, default=None)
    add_device_argument(parser)
    args = parser.parse_args()
    args.overrides = None  # the keys the cells in progress lay over --config (--peer's, for its cells)
    if args.peer is not None and not isinstance(args.peer, dict):
        parser.error("--peer takes a JSON object of config keys, such as '{\"quantization\": {\"residual\": false}}'")
    if args.deltas < 1 or args.reps < 1 or not args.sizes or not args.dirty:
        parser.error("--deltas and --reps must be at least 1, and --sizes and --dirty non-empty")
    if not all(0.0 < f <= 1.0 for f in args.dirty) or not all(s > 0 for s in args.sizes):
        parser.error("--dirty fractions must be in (0, 1] and --sizes positive")
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("cnr_torchrec").setLevel(args.log_level.upper())
    for name in ("torchrec", "torchsnapshot", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)

    device = init_process_group(args.device, parser)
    rank, world = dist.get_rank(), dist.get_world_size()
    fresh_dir(args.out_dir, rank)
    staged = StagedBytes()
    notes: dict = {"staged_bytes": "counted" if staged.available else
                   "n/a: cnr_torchrec.ckpt.checkpointer has no 'stage' to wrap"}
    cells, peer, stagers, warmups, cycles = [], {}, {}, {}, {}
    printed_header = False
    for size in args.sizes:
        rows = max(1, round(REF_ROWS * size))
        specs = [TableSpec(f"t{i}", rows, DIM, "row_wise" if i % 2 == 0 else "table_wise") for i in range(TABLES)]
        model_bytes = TABLES * rows * (DIM * 4 + 4)
        progress(f"size x{size:g}: {TABLES} tables x {rows:,d} rows x {DIM}, {model_bytes / 1e9:.2f} GB of fp32 "
                 "tables + optimizer state; building")
        dmp, opt = build(specs, world, device)
        warmups[f"{size:g}"] = warm_up(dmp, opt, specs, size, args, rank, world, staged, notes)
        for frac in args.dirty:
            progress(f"cell x{size:g}, dirty {frac:g}")
            cell = run_cell(dmp, opt, specs, size, frac, args, rank, world, staged, notes)
            cell["model_bytes"] = model_bytes
            cells.append(cell)
            if rank == 0:
                if not printed_header:
                    print(f"config {args.config} (root per cell, compaction null, on_busy wait); "
                          f"{world} ranks; baseline + {args.deltas} deltas per cell, "
                          f"{args.steps_per_interval} steps of {args.batch_size}/rank apart")
                    print(HEADER, flush=True)
                    printed_header = True
                print(row(cell), flush=True)
                print(f"      warm restore: {breakdown_line(cell['restore_breakdown'])}", flush=True)
            if args.peer:
                progress(f"cell x{size:g}, dirty {frac:g}, with {json.dumps(args.peer)}")
                other = run_cell(dmp, opt, specs, size, frac, argparse.Namespace(**{**vars(args),
                                 "overrides": args.peer}), rank, world, staged, notes)
                cell["peer_config"] = other
                if rank == 0:
                    print(f"      with {json.dumps(args.peer)}: {row(other)}", flush=True)
                    print(f"      its warm restore: {breakdown_line(other['restore_breakdown'])}", flush=True)
        if args.compaction_cycle:
            frac = max(args.dirty)
            progress(f"cell x{size:g}, dirty {frac:g}, compaction max_chain {args.compaction_cycle}")
            cycles[size] = run_compaction_cycle(dmp, opt, specs, size, frac, args, rank, world, staged, notes)
            if rank == 0:
                c = cycles[size]
                print(f"x{size:g} compaction cycle (max_chain {c['max_chain']}, dirty {frac:g}): restores "
                      + ", ".join(f"{r['restore_warm_ms']:.0f}" for r in c["restores"])
                      + f" ms; worst {c['worst_restore_warm_ms']:.0f} ms: {breakdown_line(c['worst_breakdown'])}",
                      flush=True)
        peer[size] = peers(dmp, args, rank, size, stagers)
        if rank == 0:
            print(peer_line(size, peer[size]), flush=True)
            if args.peer:
                print(side_by_side(size, [c for c in cells if c["size"] == size], peer[size], args), flush=True)
        del dmp, opt
        settle_memory()
        dist.barrier()

    largest = max(args.sizes)
    tg = targets(cells, peer[largest], largest)
    if largest in cycles:  # reported, not judged: the issue asks for the worst restore of a compaction cycle
        worst, load_warm = cycles[largest]["worst_restore_warm_ms"], peer[largest]["dcp_load"]["warm_ms"]
        tg["restore_compaction_worst"] = {
            "what": f"worst warm restore over a compaction cycle (max_chain {args.compaction_cycle}) / DCP load warm",
            "value": worst / load_warm if load_warm else None, "limit": None, "pass": None, "size": largest,
            "restore_ms": worst, "dcp_load_ms": load_warm}
    elapsed = slowest(time.perf_counter() - T0)
    if rank == 0:
        print("\nsizes in MB (1e6 bytes); stall and bg (background) are the slowest rank's; peak+ and staged are "
              "the baseline's, largest rank; pk/st = peak extra / staged bytes; restore of the baseline + "
              f"{args.deltas} deltas (median of {args.reps}); wait = first delta stall - other deltas' median")
        ev = [c["eviction"] for c in cells] + [p["dcp_load"]["eviction"] for p in peer.values()]
        after = [e.get("resident_after_max") for e in ev if e]
        shown = "could not check (mincore failed)" if None in after or not after else (
            f"pages still cached after eviction: at most {max(after):.1%}")
        print(f"cold = after {EVICTION}; {shown}")
        for key in ("chunk_bytes", "io_threads"):
            if key in notes:
                print(f"{key}: {notes[key]}")
        print(f"staged bytes: {notes['staged_bytes']}")
        stg = peer[largest]["dcp_async_save"]
        for name, err in stg["stager_errors"].items():
            print(f"dcp.async_save with {name} failed: {err}")
        print(f"dcp.async_save at x{largest:g}: " + ", ".join(
            f"{n} blocks {v['blocking_ms']:.0f} ms (total {v['total_ms']:.0f} ms)" for n, v in stg["stagers"].items())
            + f"; targets use {stg['stager']}")
        print(f"\ntargets at x{largest:g} (consecutive, adaptive 4-bit, compact storage):")
        for name, t in tg.items():
            v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
            judged = "(reported)" if t["limit"] is None else f"<= {t['limit']:<8.3g} {'pass' if t['pass'] else 'FAIL'}"
            print(f"  {name:<26s} {v:>9s}  {judged:<18s} {t['what']}")
        print(f"run time {elapsed:.0f} s")
        if args.json:
            out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "keep", "log_level")}
                   | {"world_size": world}, "notes": notes, "warmup_saves": warmups, "cells": cells,
                   "peers": {f"{s:g}": p for s, p in peer.items()}, "targets": tg, "run_time_s": elapsed,
                   "compaction_cycles": {f"{s:g}": c for s, c in cycles.items()}}
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    finish(args.out_dir, args.keep, rank)


if __name__ == "__main__":
    main()
