"""CPR: full recovery vs partial recovery vs partial recovery with SSU, under injected failures.

Run on 2 ranks:  torchrun --standalone --nproc_per_node 2 benchmarks/cpr.py [--json PATH]

Every scenario trains the same DLRM (cnr_dlrm.dlrm) on the same synthetic Criteo
stream (cnr_dlrm.data) from the same seed, checkpointing with the consecutive policy
every ``--interval`` steps (by default the interval that partial recovery's rule gives for
``--target-lost-fraction`` at this failure rate), and fails rank 1 at each ``--fail-at`` step:

* ``none``: no failure; the reference logloss.
* ``full``: every rank restores the newest checkpoint and re-trains the steps since
  (the data readers rewind with it); nothing is lost, the steps since are redone.
* ``partial``: rank 1's state is wiped (a replaced process) and ``Checkpointer.recover([1])``
  reloads only its shards and its reader position; rank 0 keeps its live rows and the
  dense state comes from it. No step is redone; the failed shards' updates since the
  checkpoint are lost.
* ``partial_ssu``: the same, with CPR's budget-limited saves: each delta writes at most
  ``--budget`` of a shard's rows, the most often updated first by SSU counters (a
  ``--ssu-rate`` sample of lookups); rows left out wait for a later save.

It reports, per scenario: bytes read from storage by recoveries, steps redone, updates
lost (rank-1 steps rolled back without being redone), final eval logloss and its
relative change against ``none``. ``--json`` writes ``reload_bytes_ratio`` (partial /
full), ``dlogloss_full``, ``dlogloss_partial`` and ``dlogloss_partial_ssu`` (relative),
with the raw figures. Checkpoint rows are 8-bit adaptive by default (``--method none``
for fp32, with which full recovery retraces the failure-free run).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist

from cnr_torchrec import CheckNRunDMP, Checkpointer, load_config
from cnr_torchrec.ckpt.failure_rates import lost_fraction

# The repository root, for the example job and models (cnr_dlrm, examples), which are not in the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cnr_dlrm.data import ClickDataset, DataConfig, ResumableReader, SyntheticCriteo, make_loader  # noqa: E402
from cnr_dlrm.dlrm import ModelConfig, build_model, build_plan, dense_parameters, make_sharder  # noqa: E402
from cnr_dlrm.train import evaluate  # noqa: E402

SCENARIOS = ("none", "full", "partial", "partial_ssu")


def build(args, stream):
    from torchrec.distributed.types import ShardingEnv

    world = dist.get_world_size()
    mcfg = ModelConfig(embedding_dim=16, dense_arch_layer_sizes=(32, 16), over_arch_layer_sizes=(64, 1),
                       row_wise_min_rows=args.row_wise_min_rows)
    model = build_model(mcfg, stream.table_rows, stream.keys, torch.device("cpu"))
    sharder = make_sharder("rowwise_adagrad", args.lr)
    plan = build_plan(model, sharder, world, mcfg.row_wise_min_rows)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=plan, sharders=[sharder])
    dense = dense_parameters(dmp, dmp.dirty_tracker.module_fqns())
    opt = torch.optim.Adagrad([p for _, p in dense], lr=args.lr)
    return dmp, opt


def wipe(dmp, opt) -> None:
    """What a replaced process starts from: fresh random rows and dense weights, no optimizer state.

    (Its reader position is lost too; recover() gives back the one saved with the checkpoint.)
    """
    tracker = dmp.dirty_tracker
    with torch.no_grad():
        for table in tracker.tables():
            for kernel, shard in tracker.shards(table):
                kernel.tbe.split_embedding_weights()[shard.local_index].uniform_(-0.01, 0.01)
                for state in kernel.tbe.split_optimizer_states()[shard.local_index]:
                    state.zero_()
        for name, p in dmp.named_parameters():
            if "sparse_arch" not in name:
                p.normal_(0, 0.05)
    opt.state.clear()
    tracker.reset(baseline=True)


def run(scenario: str, args, stream, out_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(out_dir, scenario)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    torch.manual_seed(0)
    dmp, opt = build(args, stream)
    dataset = ClickDataset(stream, rank, args.batch_size, args.steps * 2, split="train")
    reader = ResumableReader(make_loader(dataset))
    # Plain coding, as in the committed figures (docs/cpr.md); residual: auto would code residuals.
    quant = {"method": args.method, "bits": None if args.method in ("none", "fp16", "bf16") else args.bits,
             "residual": False}
    config = {"root": root, "policy": "consecutive", "quantization": quant, "compaction": None,
              "failure": {"recovery": "full" if scenario == "full" else "partial"}}
    if scenario == "partial_ssu":
        config["budget"] = {"max_rows_fraction": args.budget, "priority": "ssu", "ssu_rate": args.ssu_rate}
    ck = Checkpointer(dmp, load_config(config), dense_optimizer=opt, extra_state={"reader": reader})
    fails = sorted(args.fail_at) if scenario != "none" else []
    it = iter(reader)
    step, redone, lost_updates, reloaded, recoveries, saves = 0, 0, 0, 0, 0, 0
    t0 = time.perf_counter()
    while step < args.steps:
        step += 1
        batch = next(it)
        loss, _ = dmp(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reader.step_done()
        if step % args.interval == 0:
            ck.save(step)
            saves += 1
        if fails and step == fails[0]:
            fails.pop(0)
            ck.wait()
            recoveries += 1
            if scenario == "full":
                back_to = ck.restore()
                redone += step - back_to
                step = back_to
                reloaded += restore_bytes_read(ck)
            else:
                if rank == 1:
                    wipe(dmp, opt)
                info = ck.recover([1])
                lost_updates += step - info.step
                reloaded += info.bytes_read  # the failed ranks' reads, summed over them by recover()
            it = iter(reader)
    ck.wait()
    ck.close()
    metrics = evaluate(dmp, stream, rank, world, args.batch_size, args.eval_batches, torch.device("cpu"))
    return {"scenario": scenario, "logloss": metrics["logloss"], "auc": metrics["auc"], "saves": saves,
            "recoveries": recoveries, "bytes_reloaded": reloaded, "steps_redone": redone,
            "failed_rank_steps_lost": lost_updates, "wall_s": time.perf_counter() - t0}


def restore_bytes_read(ck: Checkpointer) -> int:
    """The bytes the last restore() read from storage on every rank together (``last_restore_stats``: each
    rank's reads, range reads and mapped chunk bytes alike). Collective."""
    total = torch.tensor([int(ck.last_restore_stats.get("bytes_read", 0))], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--interval", type=int, default=None,
                        help="steps between checkpoints (default: from --target-lost-fraction)")
    parser.add_argument("--target-lost-fraction", type=float, default=0.05,
                        help="partial recovery's target share of lost updates; sets the interval (failure_rates.py rule)")
    parser.add_argument("--fail-at", type=int, nargs="+", default=[75, 155, 215], help="steps at which rank 1 fails")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--scale", type=float, default=0.003, help="Criteo cardinalities x this")
    parser.add_argument("--row-wise-min-rows", type=int, default=5000)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--method", type=str, default="adaptive", help="codec of the checkpoints' rows")
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.25, help="partial_ssu: max_rows_fraction per delta")
    parser.add_argument("--ssu-rate", type=float, default=0.1)
    parser.add_argument("--eval-batches", type=int, default=40)
    parser.add_argument("--out-dir", type=str, default="/tmp/cnr_bench_cpr")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() < 2:
        raise SystemExit("run with torchrun --nproc_per_node 2 (rank 1 is the one that fails)")
    world = dist.get_world_size()
    mtbf_steps = args.steps / len(args.fail_at)
    if args.interval is None:  # T = 2 * MTBF * world_size * target, in steps (cnr_torchrec.ckpt.failure_rates)
        args.interval = max(1, round(2 * mtbf_steps * world * args.target_lost_fraction))
    predicted = lost_fraction(args.interval, mtbf_steps, world)
    stream = SyntheticCriteo(DataConfig(scale=args.scale, min_rows=64, batch_size=args.batch_size, signal=2.0))
    results = {s: run(s, args, stream, args.out_dir) for s in SCENARIOS}
    if dist.get_rank() == 0:
        ref = results["none"]["logloss"]
        print(f"\nCPR benchmark: {dist.get_world_size()} ranks, {args.steps} steps, checkpoint every {args.interval}, "
              f"rank 1 fails at {args.fail_at}; {sum(stream.table_rows)} embedding rows")
        print(f"{'scenario':<13}{'logloss':>10}{'dlogloss rel':>14}{'AUC':>8}{'reloaded MB':>13}{'steps redone':>14}"
              f"{'rank-1 steps lost':>19}{'wall s':>8}")
        for s, r in results.items():
            r["dlogloss_rel"] = (r["logloss"] - ref) / ref
            print(f"{s:<13}{r['logloss']:>10.5f}{r['dlogloss_rel']:>+14.2e}{r['auc']:>8.4f}"
                  f"{r['bytes_reloaded'] / 1e6:>13.2f}{r['steps_redone']:>14d}{r['failed_rank_steps_lost']:>19d}"
                  f"{r['wall_s']:>8.1f}")
        full_bytes = results["full"]["bytes_reloaded"]
        lost = results["partial"]["failed_rank_steps_lost"] / (args.steps * world)
        print(f"\nlost updates (partial): {lost:.2%} of rank-steps; expected {predicted:.2%} for an interval of "
              f"{args.interval} steps and a failure every {mtbf_steps:.0f} steps "
              f"(target {args.target_lost_fraction:.2%})")
        figures = {
            "reload_bytes_ratio": results["partial"]["bytes_reloaded"] / full_bytes if full_bytes else math.nan,
            "dlogloss_full": results["full"]["dlogloss_rel"],
            "dlogloss_partial": results["partial"]["dlogloss_rel"],
            "dlogloss_partial_ssu": results["partial_ssu"]["dlogloss_rel"],
            "lost_update_fraction_partial": lost,
            "lost_update_fraction_expected": predicted,
        }
        print("\n" + ", ".join(f"{k} {v:.4g}" for k, v in figures.items())
              + f"  (target: reload_bytes_ratio <= 1/world_size = {1 / dist.get_world_size():.2f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**figures, "scenarios": results, "config": vars(args)}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
