"""Publishing: what a follower reads and spends per committed delta, beside a full export and reload.

Run on 2 ranks:  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/publish.py [--json PATH]
Quick run:       ... benchmarks/publish.py --sizes 1 --dirty 0.01 --deltas 2

The model is benchmarks/scale.py's (the reference model of benchmarks/checkpoint.py: 8 tables x 32 dim, half
row_wise, half table_wise, 211 MB of tables and row-wise Adagrad state per size multiple), trained on exactly
``--dirty`` of each table's rows between two saves (scale.py's ``train_interval``), saved with the default config
(consecutive, adaptive 4-bit, residual coding), compaction off. Rank 0 also runs a follower serving every table
into an unsharded float32 state_dict (the training model's names). After each commit both ranks meet at a
barrier, then rank 0:

- polls the follower: the delta's bytes read (its parts and the payload bytes of the served tables' rows), the
  rows it wrote, the apply time, and the lag from the commit (the manifest's time) to served;
- the peer, in the same run: ``cnr export``'s full export of the same checkpoint and its copy into the same
  state_dict (what a server that reloads the whole model does), timed;
- a full int8 publish of the same tables, in bytes: every row as TorchRec's int8 row-wise tables hold it
  (``dim`` codes, a 2-byte scale and bias each, rounded up to 16 bytes as FBGEMM's TBE aligns rows).

Each figure is the median over the ``--deltas`` deltas of a cell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint import build  # noqa: E402
from scale import DIM, REF_ROWS, TABLES, pooling_for, train_interval  # noqa: E402

from cnr_torchrec import Checkpointer, load_config  # noqa: E402
from cnr_torchrec.ckpt.format.storage import Storage  # noqa: E402
from cnr_torchrec.ckpt.tools.export import export_state_dict  # noqa: E402
from cnr_torchrec.publish import Follower  # noqa: E402
from examples.toy import TableSpec  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def int8_row_bytes(dim: int) -> int:
    """A row of an int8 row-wise TBE table: ``dim`` codes and a 4-byte fp16 scale and bias, 16-byte aligned."""
    return -(-(dim + 4) // 16) * 16


def run_cell(dmp, opt, specs, size: float, frac: float, args, rank: int, world: int) -> dict | None:
    root = os.path.join(args.out_dir, f"x{size:g}-d{frac:g}")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    config = load_config(os.path.join(REPO, "configs", "consecutive.yaml"), root=root, compaction=None,
                         on_busy="wait", memory_tier="off")
    pooling = max(pooling_for(s.rows, frac, args, world) for s in specs)
    out: dict = {"size": size, "dirty": frac, "deltas": []}
    follower = target = None
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for k in range(args.deltas + 1):
            train_interval(dmp, opt, specs, frac, k, pooling, args, rank, world)
            info = ck.save(k + 1).wait()
            dist.barrier()
            if rank != 0:
                continue
            if follower is None:
                target = {name: torch.zeros(s.rows, DIM) for s, name in zip(specs, _fqns(root, specs))}
                follower = Follower(root, target)
                (first,) = follower.poll()
                out["first_load_ms"] = first.apply_ms
                continue
            (update,) = follower.poll()
            assert update.how == "delta", update
            storage = Storage(root)
            t0 = time.perf_counter()
            full = export_state_dict(storage, info.id)
            for name, t in target.items():
                t.copy_(full[name])
            peer_ms = (time.perf_counter() - t0) * 1e3
            storage.close()
            out["deltas"].append({"ckpt": update.ckpt, "bytes_read": update.bytes_read, "rows": update.rows,
                                  "apply_ms": update.apply_ms, "lag_s": update.lag_s, "export_reload_ms": peer_ms,
                                  "checkpoint_bytes": info.nbytes})
    if follower is not None:
        follower.close()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    if rank != 0:
        return None
    int8 = sum(s.rows * int8_row_bytes(DIM) for s in specs)
    med = {k: statistics.median(d[k] for d in out["deltas"]) for k in out["deltas"][0] if k != "ckpt"}
    out.update(median=med, int8_publish_bytes=int8, int8_over_read=int8 / med["bytes_read"],
               apply_over_export=med["apply_ms"] / med["export_reload_ms"],
               read_over_checkpoint=med["bytes_read"] / med["checkpoint_bytes"])
    return out


def _fqns(root: str, specs) -> list[str]:
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

    storage = Storage(root)
    try:
        fqns = load_manifest(storage, max(committed_ids(storage))).table_fqns
    finally:
        storage.close()
    return [fqns[s.name] for s in specs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=lambda v: [float(x) for x in v.split(",")], default=[1.0])
    p.add_argument("--dirty", type=lambda v: [float(x) for x in v.split(",")], default=[0.01, 0.1, 0.27])
    p.add_argument("--deltas", type=int, default=3)
    p.add_argument("--steps-per-interval", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--min-pooling", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default="/tmp/cnr_bench_publish")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out_dir, exist_ok=True)
    cells = []
    for size in args.sizes:
        rows = max(1, round(REF_ROWS * size))
        specs = [TableSpec(f"t{i}", rows, DIM, "row_wise" if i % 2 == 0 else "table_wise") for i in range(TABLES)]
        dmp, opt = build(specs, world)
        for frac in args.dirty:
            cell = run_cell(dmp, opt, specs, size, frac, args, rank, world)
            if cell is not None:
                cells.append(cell)
                m = cell["median"]
                print(f"x{size:g} ({TABLES * rows * DIM * 4 / 1e6:.0f} MB of float tables), dirty {frac:g}: a delta "
                      f"read {m['bytes_read'] / 1e6:.2f} MB ({cell['read_over_checkpoint']:.2f}x its checkpoint's "
                      f"{m['checkpoint_bytes'] / 1e6:.2f} MB), wrote {m['rows']:,.0f} rows in {m['apply_ms']:.0f} ms "
                      f"({cell['apply_over_export']:.3f}x the {m['export_reload_ms']:.0f} ms of a full export and "
                      f"reload), served {m['lag_s']:.2f} s after its commit; a full int8 publish is "
                      f"{cell['int8_publish_bytes'] / 1e6:.1f} MB, {cell['int8_over_read']:.1f}x the delta's bytes",
                      flush=True)
        del dmp, opt
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": cells}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
