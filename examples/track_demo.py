"""Short 2-rank training of a small sharded model that prints dirty rows per table each step.

Run from the repository root (``examples`` is a top-level package there, not part of the
installed library) with ``torchrun --standalone --nproc_per_node 2 -m examples.track_demo``.
Works on CPU (gloo) and CUDA (nccl).
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingEnv

from cnr_torchrec import CheckNRunDMP

from examples.toy import TableSpec, ToyModel, build_plan, sharders_for, zipf_batch


def global_dirty_counts(tracker) -> dict[str, int]:
    """Dirty rows of each table over all ranks (column shards of a row counted once)."""
    local = tracker.dirty_counts()
    names = tracker.tables()
    summed = torch.tensor([local[t] for t in names], dtype=torch.int64)
    maxed = summed.clone()
    dist.all_reduce(summed)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    out = {}
    for i, t in enumerate(names):
        # Row shards add up; column shards and replicas hold the same rows on every rank.
        replicated = tracker.sharding_type(t) in ("column_wise", "data_parallel")
        out[t] = int(maxed[i] if replicated else summed[i])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    specs = [
        TableSpec("user_tw", args.rows, 16, "table_wise"),
        TableSpec("item_rw", args.rows * 4, 16, "row_wise"),
        TableSpec("ctx_cw", args.rows, 16, "column_wise"),
        TableSpec("geo_trw", args.rows, 16, "table_row_wise"),
        TableSpec("lang_dp", 500, 16, "data_parallel"),
    ]
    torch.manual_seed(0)
    model = ToyModel(specs)
    sharders = sharders_for()
    plan = build_plan(model, sharders, world, device_type=device.type)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device, plan=plan,
                       sharders=sharders)
    dense_opt = torch.optim.Adagrad([p for n, p in dmp.named_parameters() if "dense" in n], lr=0.05)
    tracker = dmp.dirty_tracker
    rows = {s.name: s.rows for s in specs}
    gen = torch.Generator().manual_seed(1234 + rank)
    if rank == 0:
        print(f"{world} ranks, {len(specs)} tables, tracking at {tracker.bits_per_row:.2f} bits/row")
        print("step  loss    " + "  ".join(f"{t:>18s}" for t in tracker.tables()))
    for step in range(args.steps):
        loss = dmp(zipf_batch(specs, args.batch_size, pooling=8, generator=gen).to(device))
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        counts = global_dirty_counts(tracker)
        if rank == 0:
            cells = "  ".join(f"{counts[t]:>8d} ({counts[t] / rows[t]:6.1%})" for t in tracker.tables())
            print(f"{step:4d}  {loss.item():.4f}  {cells}", flush=True)
        tracker.reset()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
