"""Tracking overhead: no tracking vs CheckNRunDMP vs torchrec's ModelDeltaTracker (ID_ONLY).

Run on 2 ranks:  torchrun --standalone --nproc_per_node 2 benchmarks/tracking.py [--json PATH]
On GPUs:         torchrun --standalone --nproc_per_node N benchmarks/tracking.py --device cuda

Workload (issue 2): 8 tables x 200k rows x 32 dim, half row_wise and half table_wise,
batch 2048 per rank, pooling 20, Zipf-skewed ids, EXACT_ROWWISE_ADAGRAD.

Design, for a machine whose step time wanders by ~15% from one step to the next:

* Both overheads are paired on one model. overhead_cnr compares the CheckNRunDMP model
  with itself, its hooks detached (``tracker.remove()``) or attached; overhead_cnr_no_takeover
  does the same with a tracker that leaves FBGEMM's bounds check on
  (``fuse_bounds_check=False``), the cost of tracking alone; overhead_mdt does the
  same with the ModelDeltaTracker model, its post-lookup hook (``post_lookup_tracker_fn``
  of each sharded module) unset or set. Separate models of the same size differ by a few
  percent whatever they track (placement in memory); the plain-DMP comparisons print that.
* The configurations are interleaved step by step: each batch runs once in every
  configuration, back to back, in an order that rotates. Each paired ratio compares two
  runs of the same batch a few tens of ms apart, so slow drifts in machine load cancel.
  Every timed step starts after a barrier and counts the slowest rank.
* On CPU each rank is pinned to its own core, which cuts the scheduler's share of the noise.
* The overheads are medians of the per-step paired ratios; their spread is printed.

By default the CheckNRunDMP hooks also stand in for FBGEMM's own bounds check of the
lookups they mark (see DirtyRowTracker), so overhead_cnr can be below zero: the benchmark
replays both passes on one step's real inputs to show where the time goes.

``--device cuda``: NCCL, rank r on ``cuda:r`` (its local rank), the models and batches on
the GPU, and every timed region bracketed by ``torch.cuda.synchronize()``; it reports the
same figures. There, tracking is sync-free and FBGEMM keeps its bounds check, so ``cnr`` and
``cnr_nt`` run the same code and the replayed mark_rows is not offset by a skipped check;
the CPU-time figures are the host thread's, waits for the GPU included. Without a GPU it
exits with status 2 and a message (under torchrun, torchrun then reports the failed ranks).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode
from torchrec.distributed.types import ShardingEnv

from cnr_torchrec import CheckNRunDMP
from cnr_torchrec.track import DirtyRowTracker

# The repository root, for the example job and models (cnr_dlrm, examples), which are not in the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.toy import TableSpec, ToyModel, build_plan, sharders_for, zipf_batch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dist import add_device_argument, init_process_group, sync  # noqa: E402


def build(kind: str, specs, world: int, device: torch.device):
    torch.manual_seed(0)
    model = ToyModel(specs)
    sharders = sharders_for(EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.01)
    plan = build_plan(model, sharders, world, device_type=device.type)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    cls = CheckNRunDMP if kind == "cnr" else DistributedModelParallel
    dmp = cls(model, env=env, device=device, plan=plan, sharders=sharders)
    mdt = dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY)) if kind == "mdt" \
        else None
    opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "dense" in n], lr=0.01)
    return dmp, mdt, opt


def step(dmp, opt, batch) -> None:
    loss = dmp(batch)
    loss.backward()
    opt.step()
    opt.zero_grad()



def extract(kind: str, dmp, mdt) -> None:
    if kind == "cnr":
        tracker = dmp.dirty_tracker
        for t in tracker.tables():
            tracker.dirty_rows(t)
        tracker.reset()
    elif kind == "mdt":
        mdt.get_unique_ids()


def replayed_ms(dmp, opt, batch, repeats: int = 20) -> tuple[float, float]:
    """One step's marking pass, and FBGEMM's bounds check of the same lookups, replayed.

    Both run on that step's real TBE inputs, away from the noise of whole steps.
    Returns (mark_rows ms, bounds_check_indices ms) per step.
    """
    from cnr_torchrec import ops

    captured = []
    handles = []
    tracker = dmp.dirty_tracker
    for state in tracker._kernels:  # noqa: SLF001
        if state.info.data_parallel:
            continue

        def grab(module, args, kwargs, state=state):
            captured.append((module, kwargs["indices"].clone(), kwargs["offsets"].clone(), state.bits.bitmap.clone()))

        handles.append(state.info.tbe.register_forward_pre_hook(grab, with_kwargs=True))
    step(dmp, opt, batch)
    for h in handles:
        h.remove()
    # On CUDA the hook records problems on the device (no host read per lookup); so does the replay.
    errors = ops.lookup_record(captured[0][1].device) if captured and captured[0][1].is_cuda else None
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        for tbe, indices, offsets, bitmap in captured:
            ops.mark_rows(indices, offsets, tbe.hash_size_cumsum, tbe.rows_per_table, bitmap, errors=errors)
    sync()
    mark = (time.perf_counter() - t0) * 1e3 / repeats
    warning = BoundsCheckMode.WARNING.value  # FBGEMM's default; valid ids are left as they are
    t0 = time.perf_counter()
    for _ in range(repeats):
        for tbe, indices, offsets, _ in captured:
            torch.ops.fbgemm.bounds_check_indices(tbe.rows_per_table, indices, offsets, warning,
                                                  tbe.bounds_check_warning, None)
    sync()
    return mark, (time.perf_counter() - t0) * 1e3 / repeats


def profile_step(dmp, opt, batch, set_tracking, path: str) -> dict:
    """One step of the CheckNRunDMP model with its hooks off, then on, under ``torch.profiler``.

    Writes both Chrome traces beside ``path`` and returns where the tracked step's extra time goes:
    the device time of the marking kernels, the host time of the ``cnr`` ops (dispatch and launch),
    and the kernels and host time each step takes in all.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else [])
    out = {}
    for kind in ("cnr_off", "cnr"):
        set_tracking(dmp, kind)
        step(dmp, opt, batch)  # the fresh tracker's first step, outside the trace
        sync()
        with profile(activities=activities, with_stack=True) as prof:
            t0 = time.perf_counter()
            step(dmp, opt, batch)
            sync()
            wall = (time.perf_counter() - t0) * 1e3
        prof.export_chrome_trace(f"{path}.{kind}.json")
        with open(f"{path}.{kind}.json") as f:
            trace = json.load(f)["traceEvents"]
        # The tracker's hooks on each TBE (Python, the cnr op calls inside them included).
        hooks = [e for e in trace if e.get("cat") == "python_function"
                 and re.search(r"track/hooks\.py\(\d+\): (hook|post_hook)$", e["name"])]
        events = prof.events()
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        cnr_ops = [e for e in events if e.device_type.name == "CPU" and e.name.startswith("cnr::")]
        out[kind] = {
            "wall_ms": wall,
            "kernels": len(kernels),
            "kernel_ms": sum(e.device_time_total for e in kernels) / 1e3 if kernels else 0.0,
            "mark_kernel_ms": sum(e.device_time_total for e in kernels if "mark" in e.name) / 1e3,
            "cnr_ops": len(cnr_ops),
            "cnr_op_host_ms": sum(e.cpu_time_total for e in cnr_ops) / 1e3,
            "hook_calls": len(hooks),
            "hook_host_ms": sum(e["dur"] for e in hooks) / 1e3,
        }
    return out


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def pin_to_own_core() -> None:
    """Pins this rank (and the threads it starts later) to one core of its own, where there are enough."""
    cores = sorted(os.sched_getaffinity(0))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if len(cores) >= local_world:
        os.sched_setaffinity(0, {cores[local_rank]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=8, help="batches per round, each timed once per configuration")
    parser.add_argument("--extractions", type=int, default=10, help="timed extractions per tracker")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--profile", type=str, default=None,
                        help="also profile one step with the hooks off and on (torch.profiler); Chrome traces "
                             "go to PROFILE.cnr_off.json and PROFILE.cnr.json on rank 0")
    add_device_argument(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)

    if args.device == "cpu":
        pin_to_own_core()  # before gloo starts its threads, so that they stay on this rank's core too
    device = init_process_group(args.device, parser)
    rank, world = dist.get_rank(), dist.get_world_size()
    specs = [TableSpec(f"t{i}", args.rows, args.dim, "row_wise" if i % 2 == 0 else "table_wise")
             for i in range(args.tables)]
    gen = torch.Generator().manual_seed(rank)
    batches = [zipf_batch(specs, args.batch_size, args.pooling, gen).to(device) for _ in range(args.steps)]
    kinds = ["none", "cnr", "mdt"]
    models = {k: build(k, specs, world, device) for k in kinds}
    for k in kinds:  # warm-up
        dmp, mdt, opt = models[k]
        for b in batches[:2]:
            step(dmp, opt, b)
        extract(k, dmp, mdt)

    def set_tracking(dmp, kind: str) -> None:
        """Detaches CheckNRunDMP's hooks, then attaches a fresh tracker for ``cnr`` (bounds check taken
        over) or ``cnr_nt`` (FBGEMM's check left on); the same model either way."""
        dmp.dirty_tracker.remove()
        if kind != "cnr_off":
            dmp.dirty_tracker = DirtyRowTracker(dmp, fuse_bounds_check=kind == "cnr")

    # The modules ModelDeltaTracker hooked, and their hooks, to unset and set again (same model either way).
    mdt_hooks = [(m, m.post_lookup_tracker_fn) for m in models["mdt"][0].modules()
                 if getattr(m, "post_lookup_tracker_fn", None) is not None]
    assert mdt_hooks, "ModelDeltaTracker registered no post-lookup hook"

    def set_mdt(on: bool) -> None:
        for module, fn in mdt_hooks:
            module.post_lookup_tracker_fn = fn if on else None

    timed_kinds = kinds + ["cnr_nt", "cnr_off", "mdt_off"]
    models["cnr_nt"] = models["cnr_off"] = models["cnr"]
    models["mdt_off"] = models["mdt"]
    n = len(timed_kinds)
    # Per (round, batch, configuration): wall ms and training-thread CPU ms of one step on this rank.
    wall = torch.zeros(args.rounds, len(batches), n, dtype=torch.float64)
    cpu = torch.zeros_like(wall)
    extract_ms = {k: [] for k in kinds if k != "none"}
    for r in range(args.rounds):
        for i, b in enumerate(batches):
            rot = (r * len(batches) + i) % n  # rotate who goes first
            for j in list(range(rot, n)) + list(range(rot)):
                k = timed_kinds[j]
                dmp, mdt, opt = models[k]
                if k in ("cnr", "cnr_nt", "cnr_off"):
                    set_tracking(dmp, k)
                if k in ("mdt", "mdt_off"):
                    set_mdt(k == "mdt")
                sync()
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                step(dmp, opt, b)
                sync()
                wall[r, i, j], cpu[r, i, j] = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
        extract("mdt", *models["mdt"][:2])  # untimed: ModelDeltaTracker keeps every step's ids until then
    # Extraction, apart from the timed steps: each tracker first records a round of batches.
    set_mdt(True)
    set_tracking(models["cnr"][0], "cnr")
    for _ in range(args.extractions):
        for k in extract_ms:
            dmp, mdt, opt = models[k]
            for b in batches:
                step(dmp, opt, b)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            extract(k, dmp, mdt)
            sync()
            extract_ms[k].append(slowest((time.perf_counter() - t0) * 1e3))
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    cpu_mean = cpu.clone()
    dist.all_reduce(cpu_mean)  # CPU time: the ranks' mean
    cpu_mean /= world
    col = {k: j for j, k in enumerate(timed_kinds)}
    med = {k: float(wall[..., col[k]].median()) for k in timed_kinds}

    def ratios(k: str, ref: str, times: torch.Tensor = wall) -> torch.Tensor:
        return (times[..., col[k]] / times[..., col[ref]] - 1).flatten()

    def paired(k: str, ref: str, times: torch.Tensor = wall) -> float:
        return float(ratios(k, ref, times).median())

    def stderr(k: str, ref: str) -> float:
        """Standard error of the median paired ratio (normal approximation: 1.2533 sd / sqrt(n))."""
        x = ratios(k, ref)
        return float(1.2533 * x.std() / x.numel() ** 0.5)

    cnr_dmp, _, cnr_opt = models["cnr"]
    mark_ms, fbgemm_check_ms = (slowest(x) for x in replayed_ms(cnr_dmp, cnr_opt, batches[0]))
    traced = profile_step(cnr_dmp, cnr_opt, batches[0], set_tracking, f"{args.profile}.rank{rank}") \
        if args.profile else None
    # The check that the marking pass makes redundant, where it takes it over (CPU); on CUDA FBGEMM's stays on.
    skipped_ms = fbgemm_check_ms if cnr_dmp.dirty_tracker.fused_bounds_check else 0.0
    res = {
        "step_ms_none": med["none"],
        "step_ms_cnr": med["cnr"],
        "step_ms_mdt": med["mdt"],
        "step_ms_cnr_no_takeover": med["cnr_nt"],
        "step_ms_cnr_detached": med["cnr_off"],
        "step_ms_mdt_detached": med["mdt_off"],
        "overhead_cnr": paired("cnr", "cnr_off"),
        "overhead_mdt": paired("mdt", "mdt_off"),
        "overhead_cnr_no_takeover": paired("cnr_nt", "cnr_off"),
        "overhead_cnr_stderr": stderr("cnr", "cnr_off"),
        "overhead_cnr_no_takeover_stderr": stderr("cnr_nt", "cnr_off"),
        "overhead_mdt_stderr": stderr("mdt", "mdt_off"),
        "overhead_cnr_vs_plain_dmp": paired("cnr", "none"),
        "overhead_mdt_vs_plain_dmp": paired("mdt", "none"),
        "overhead_detached_vs_plain_dmp": paired("cnr_off", "none"),
        "overhead_cnr_cpu": paired("cnr", "cnr_off", cpu_mean),
        "overhead_cnr_no_takeover_cpu": paired("cnr_nt", "cnr_off", cpu_mean),
        "overhead_mdt_cpu": paired("mdt", "mdt_off", cpu_mean),
        "mark_ms_per_step_cnr": mark_ms,
        "fbgemm_bounds_check_ms_per_step": fbgemm_check_ms,
        "overhead_cnr_attributed": (mark_ms - skipped_ms) / med["none"],
        "bits_per_row_cnr": models["cnr"][0].dirty_tracker.bits_per_row,
        "extract_ms_cnr": statistics.median(extract_ms["cnr"]),
        "extract_ms_mdt": statistics.median(extract_ms["mdt"]),
        "paired_steps": int(wall.shape[0] * wall.shape[1]),
        "device": args.device,
        "profile": traced,
    }

    def quartiles(k: str, ref: str) -> tuple[float, float]:
        x = ratios(k, ref)
        return float(x.quantile(0.25)), float(x.quantile(0.75))

    if rank == 0:
        if device.type == "cuda":
            print(f"\n{world} x {torch.cuda.get_device_name(device)}, NCCL; tracking is sync-free there and FBGEMM "
                  "keeps its bounds check, so cnr and 'FBGEMM check left on' run the same code", end="")
        print(f"\n{world} ranks, {args.tables} tables x {args.rows} rows x {args.dim}, batch {args.batch_size}/rank, "
              f"pooling {args.pooling}; {args.rounds} rounds x {args.steps} batches, each batch timed once per "
              f"configuration ({res['paired_steps']} paired steps)")
        print(f"{'config':<28s}{'step ms':>10s}{'overhead':>10s}{'+/- se':>9s}{'extract ms':>12s}")
        print(f"{'no tracking (plain DMP)':<28s}{med['none']:>10.2f}")
        print(f"{'CheckNRunDMP, hooks off':<28s}{med['cnr_off']:>10.2f}{res['overhead_detached_vs_plain_dmp']:>10.2%}")
        print(f"{'CheckNRunDMP (cnr)':<28s}{med['cnr']:>10.2f}{res['overhead_cnr']:>10.2%}"
              f"{res['overhead_cnr_stderr']:>9.2%}{res['extract_ms_cnr']:>12.2f}")
        print(f"{'  FBGEMM check left on':<28s}{med['cnr_nt']:>10.2f}{res['overhead_cnr_no_takeover']:>10.2%}"
              f"{res['overhead_cnr_no_takeover_stderr']:>9.2%}")
        print(f"{'ModelDeltaTracker, hook off':<28s}{med['mdt_off']:>10.2f}")
        print(f"{'ModelDeltaTracker ID_ONLY':<28s}{med['mdt']:>10.2f}{res['overhead_mdt']:>10.2%}"
              f"{res['overhead_mdt_stderr']:>9.2%}{res['extract_ms_mdt']:>12.2f}")
        print("overheads: medians of per-step ratios, each tracker against the same model with its hooks off "
              f"(hooks off against the plain DMP); against the plain DMP: cnr {res['overhead_cnr_vs_plain_dmp']:.2%}, "
              f"mdt {res['overhead_mdt_vs_plain_dmp']:.2%}")
        for k, ref in (("cnr", "cnr_off"), ("cnr_nt", "cnr_off"), ("mdt", "mdt_off")):
            q1, q3 = quartiles(k, ref)
            print(f"per-step {k} ratio quartiles: {q1:.2%} .. {q3:.2%}")
        print(f"on the training thread's CPU time: cnr {res['overhead_cnr_cpu']:.2%}, cnr with FBGEMM's check on "
              f"{res['overhead_cnr_no_takeover_cpu']:.2%}, mdt {res['overhead_mdt_cpu']:.2%}")
        kept = "skipped for the lookups cnr marks" if skipped_ms else "kept on"
        print(f"replayed per step: cnr mark_rows {mark_ms:.3f} ms, FBGEMM's bounds check of the same lookups "
              f"{fbgemm_check_ms:.3f} ms ({kept}): net {res['overhead_cnr_attributed']:.2%} "
              "of a step")
        print(f"cnr bits per row: {res['bits_per_row_cnr']:.3f}")
        if traced:
            off, on = traced["cnr_off"], traced["cnr"]
            print(f"profiled step, hooks off / on: wall {off['wall_ms']:.2f} / {on['wall_ms']:.2f} ms, "
                  f"{off['kernels']} / {on['kernels']} kernels taking {off['kernel_ms']:.3f} / {on['kernel_ms']:.3f} "
                  f"ms of device time; tracked: {on['hook_calls']} hook calls taking {on['hook_host_ms']:.3f} ms of host "
                  f"time, {on['cnr_op_host_ms']:.3f} ms of it in {on['cnr_ops']} cnr ops; marking kernels "
                  f"{on['mark_kernel_ms']:.3f} ms on the device (Python tracing on: host times are inflated)")
        print(f"extract_ms_cnr / extract_ms_mdt = {res['extract_ms_cnr'] / res['extract_ms_mdt']:.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
