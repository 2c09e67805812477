"""Tracking overhead: no tracking vs CheckNRunDMP vs torchrec's ModelDeltaTracker (ID_ONLY).

Run on 2 ranks:  torchrun --standalone --nproc_per_node 2 benchmarks/tracking.py [--json PATH]

Workload (issue 2): 8 tables x 200k rows x 32 dim, half row_wise and half table_wise,
batch 2048 per rank, pooling 20, Zipf-skewed ids, EXACT_ROWWISE_ADAGRAD. The three
configurations are separate models in the same processes, measured in interleaved
rounds so that machine noise hits them alike; each figure is the median over rounds of
the slowest rank's mean step time.

Both overheads are paired on one model: overhead_cnr compares the CheckNRunDMP model with
itself, its hooks detached (``tracker.remove()``) for one block of each round and attached
again for another; overhead_mdt does the same with the ModelDeltaTracker model, whose
post-lookup hook (``post_lookup_tracker_fn`` of each sharded module) is unset for one block
and set for another. The same weights, memory and kernels, so each paired ratio isolates
what its tracking adds. Separate models of the same size differ by a few percent on this
machine whatever they track (placement in memory), which the plain-DMP comparisons print.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode
from torchrec.distributed.types import ShardingEnv

from cnr_torchrec import CheckNRunDMP
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.toy import TableSpec, ToyModel, build_plan, sharders_for, zipf_batch


def build(kind: str, specs, world: int):
    torch.manual_seed(0)
    model = ToyModel(specs)
    sharders = sharders_for(EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.01)
    plan = build_plan(model, sharders, world)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    cls = CheckNRunDMP if kind == "cnr" else DistributedModelParallel
    dmp = cls(model, env=env, device=torch.device("cpu"), plan=plan, sharders=sharders)
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


def mark_cost_ms(dmp, opt, batch, repeats: int = 20) -> float:
    """Time of the tracking hooks' work for one step, replayed on that step's real TBE inputs.

    Step-time differences of ~1% drown in the noise of a shared 2-core machine; this
    isolates the cost that tracking adds.
    """
    from cnr_torchrec import ops

    captured = []
    handles = []
    for state in dmp.dirty_tracker._kernels:  # noqa: SLF001
        if state.info.data_parallel:
            continue
        hsc = state.info.tbe.hash_size_cumsum

        def grab(module, args, kwargs, state=state, hsc=hsc):
            captured.append((kwargs["indices"].clone(), kwargs["offsets"].clone(), hsc, state.bitmap.clone()))

        handles.append(state.info.tbe.register_forward_pre_hook(grab, with_kwargs=True))
    step(dmp, opt, batch)
    for h in handles:
        h.remove()
    t0 = time.perf_counter()
    for _ in range(repeats):
        for indices, offsets, hsc, bitmap in captured:
            ops.mark_rows(indices, offsets, hsc, bitmap)
    return (time.perf_counter() - t0) * 1e3 / repeats


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    specs = [TableSpec(f"t{i}", args.rows, args.dim, "row_wise" if i % 2 == 0 else "table_wise")
             for i in range(args.tables)]
    gen = torch.Generator().manual_seed(rank)
    batches = [zipf_batch(specs, args.batch_size, args.pooling, gen) for _ in range(args.steps)]
    kinds = ["none", "cnr", "mdt"]
    models = {k: build(k, specs, world) for k in kinds}
    for k in kinds:  # warm-up
        dmp, mdt, opt = models[k]
        for b in batches[:2]:
            step(dmp, opt, b)
        extract(k, dmp, mdt)

    def set_tracking(dmp, on: bool) -> None:
        """Detaches CheckNRunDMP's hooks, or attaches a fresh tracker (same model either way)."""
        if on:
            dmp.dirty_tracker = DirtyRowTracker(dmp)
        else:
            dmp.dirty_tracker.remove()

    # The modules ModelDeltaTracker hooked, and their hooks, to unset and set again (same model either way).
    mdt_hooks = [(m, m.post_lookup_tracker_fn) for m in models["mdt"][0].modules()
                 if getattr(m, "post_lookup_tracker_fn", None) is not None]
    assert mdt_hooks, "ModelDeltaTracker registered no post-lookup hook"

    def set_mdt(on: bool) -> None:
        for module, fn in mdt_hooks:
            module.post_lookup_tracker_fn = fn if on else None

    timed_kinds = kinds + ["cnr_off", "mdt_off"]
    models["cnr_off"], models["mdt_off"] = models["cnr"], models["mdt"]
    step_ms = {k: [] for k in timed_kinds}
    cpu_ms = {k: [] for k in timed_kinds}  # the training thread's CPU time: blind to waiting for a core
    extract_ms = {k: [] for k in kinds if k != "none"}
    for r in range(args.rounds):
        n = len(timed_kinds)
        order = timed_kinds[r % n:] + timed_kinds[: r % n]  # rotate who goes first
        for k in order:
            dmp, mdt, opt = models[k]
            if k in ("cnr", "cnr_off"):
                set_tracking(dmp, k == "cnr")
            if k in ("mdt", "mdt_off"):
                set_mdt(k == "mdt")
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            for b in batches:
                step(dmp, opt, b)
            step_ms[k].append(slowest((time.perf_counter() - t0) * 1e3 / len(batches)))
            cpu_ms[k].append(slowest((time.thread_time() - c0) * 1e3 / len(batches)))
            if k in extract_ms:
                dist.barrier()
                t0 = time.perf_counter()
                extract(k, dmp, mdt)
                extract_ms[k].append(slowest((time.perf_counter() - t0) * 1e3))

    med = {k: statistics.median(v) for k, v in step_ms.items()}
    # Overheads are medians of per-round paired ratios, robust to slow drifts in machine load.
    def paired(k: str, ref: str, times=step_ms) -> float:
        return statistics.median(a / b - 1 for a, b in zip(times[k], times[ref]))

    set_mdt(True)
    cnr_dmp, _, cnr_opt = models["cnr"]
    set_tracking(cnr_dmp, True)
    mark_ms = slowest(mark_cost_ms(cnr_dmp, cnr_opt, batches[0]))
    res = {
        "step_ms_none": med["none"],
        "step_ms_cnr": med["cnr"],
        "step_ms_mdt": med["mdt"],
        "step_ms_cnr_detached": med["cnr_off"],
        "step_ms_mdt_detached": med["mdt_off"],
        "overhead_cnr": paired("cnr", "cnr_off"),
        "overhead_mdt": paired("mdt", "mdt_off"),
        "overhead_cnr_vs_plain_dmp": paired("cnr", "none"),
        "overhead_mdt_vs_plain_dmp": paired("mdt", "none"),
        "overhead_detached_vs_plain_dmp": paired("cnr_off", "none"),
        "overhead_cnr_cpu": paired("cnr", "cnr_off", cpu_ms),
        "overhead_mdt_cpu": paired("mdt", "mdt_off", cpu_ms),
        "mark_ms_per_step_cnr": mark_ms,
        "overhead_cnr_attributed": mark_ms / med["none"],
        "bits_per_row_cnr": models["cnr"][0].dirty_tracker.bits_per_row,
        "extract_ms_cnr": statistics.median(extract_ms["cnr"]),
        "extract_ms_mdt": statistics.median(extract_ms["mdt"]),
    }
    # Per-round ratio spread, to show how much of the overhead is noise.
    def spread(k: str, ref: str) -> tuple[float, float, float, float]:
        r = sorted(a / b - 1 for a, b in zip(step_ms[k], step_ms[ref]))
        return r[0], r[len(r) // 4], r[(3 * len(r)) // 4], r[-1]

    spreads = {"cnr": spread("cnr", "cnr_off"), "mdt": spread("mdt", "mdt_off")}
    if rank == 0:
        print(f"\n{world} ranks, {args.tables} tables x {args.rows} rows x {args.dim}, batch {args.batch_size}/rank, "
              f"pooling {args.pooling}, {args.rounds} rounds x {args.steps} steps")
        print(f"{'config':<28s}{'step ms':>10s}{'overhead':>10s}{'extract ms':>12s}")
        print(f"{'no tracking (plain DMP)':<28s}{med['none']:>10.2f}{'':>10s}{'':>12s}")
        print(f"{'CheckNRunDMP, hooks off':<28s}{med['cnr_off']:>10.2f}"
              f"{res['overhead_detached_vs_plain_dmp']:>10.2%}{'':>12s}")
        print(f"{'CheckNRunDMP (cnr)':<28s}{med['cnr']:>10.2f}{res['overhead_cnr']:>10.2%}"
              f"{res['extract_ms_cnr']:>12.2f}")
        print(f"{'ModelDeltaTracker, hook off':<28s}{med['mdt_off']:>10.2f}{'':>10s}{'':>12s}")
        print(f"{'ModelDeltaTracker ID_ONLY':<28s}{med['mdt']:>10.2f}{res['overhead_mdt']:>10.2%}"
              f"{res['extract_ms_mdt']:>12.2f}")
        print("overheads: each tracker against the same model with its hooks off (hooks off against the plain DMP); "
              f"against the plain DMP: cnr {res['overhead_cnr_vs_plain_dmp']:.2%}, "
              f"mdt {res['overhead_mdt_vs_plain_dmp']:.2%}")
        print(f"on the training thread's CPU time: cnr {res['overhead_cnr_cpu']:.2%}, mdt {res['overhead_mdt_cpu']:.2%}")
        print(f"cnr bits per row: {res['bits_per_row_cnr']:.3f}")
        for k, (lo, q1, q3, hi) in spreads.items():
            print(f"per-round {k} overhead: min {lo:.2%}, quartiles {q1:.2%} .. {q3:.2%}, max {hi:.2%}")
        print(f"cnr mark_rows work per step, replayed: {mark_ms:.3f} ms = "
              f"{res['overhead_cnr_attributed']:.3%} of a step")
        print(f"extract_ms_cnr / extract_ms_mdt = {res['extract_ms_cnr'] / res['extract_ms_mdt']:.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
