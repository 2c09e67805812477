"""Warm start and `cnr copy`: what a warm start of half the tables costs beside a full restore and DCP's partial
load of the same tables, and what `cnr copy` costs beside a plain recursive copy, in the same run.

Run on 2 ranks:  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/warm_start.py [--json PATH]
Quick run:       ... benchmarks/warm_start.py --sizes 0.05
Copy only:       ... benchmarks/warm_start.py --sizes 1,10 --only copy   (the chain is trained and saved as in a
                 full run, then only ``cnr copy`` and its peers are timed; the warm-start figures are skipped)

The model is benchmarks/scale.py's (8 tables x 32 dim, half row_wise and half table_wise, 205 MB of float tables
per size multiple), trained on 10% of each table's rows between saves and saved with the default config: a
baseline and ``--deltas`` residual deltas (the default chain), then folded into one baseline by ``cnr compact``
(a single baseline). On each of the two roots, every rank times, best of ``--repeats``:

- ``warm_start`` of half the tables (t0, t2, t4, t6: the row_wise ones, each rank's own rows) into a second model;
- a full restore of the same checkpoint (``Checkpointer.restore()``) into the same second model;
- ``dcp.load`` of the same half of the tables, with DCP's partial-load planner, from ``cnr export --format dcp``
  of the same checkpoint (the export made beforehand, not timed).

Each figure is the slowest rank's. The bytes a warm start reads are counted at the storage layer (every rank's,
summed) against the minimal bytes: the stored bytes of the selected tables' entries in the chain. Then rank 0
times ``cnr copy`` of the chain root into a new directory against ``shutil.copytree`` of the same root, and
against ``shutil.copytree`` followed by ``os.sync()`` (the plain copy made durable, as ``cnr copy`` makes its files
before each manifest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint import build, slowest  # noqa: E402
from scale import DIM, REF_ROWS, TABLES, pooling_for, train_interval  # noqa: E402

from cnr_torchrec import Checkpointer, load_config, warm_start  # noqa: E402
from cnr_torchrec.ckpt.format.bytes.storage import Storage  # noqa: E402
from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest, walk_chain  # noqa: E402
from examples.toy import TableSpec  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HALF = [f"t{i}" for i in range(0, TABLES, 2)]


class ReadCounter:
    """Bytes read while it is on: every payload byte range the row readers fetch (their ``bytes_read``, mapped
    chunks included), and every other file read whole (manifests, parts, index)."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self.files = 0

    def __enter__(self) -> ReadCounter:
        from cnr_torchrec.ckpt.format.bytes import rows

        counter, real_init, real_read = self, rows.RowReader.__init__, Storage.read
        self._undo = (real_init, real_read)

        def init(reader, storage, payload, stats=None, *a, **kw):
            real_init(reader, storage, payload, counter.stats if stats is None else stats, *a, **kw)

        def read(storage, path, byte_range=None):
            data = real_read(storage, path, byte_range)
            if not path.endswith(".bin"):  # payload bytes are the readers' to count
                counter.files += len(data)
            return data

        rows.RowReader.__init__ = init  # type: ignore[method-assign]
        Storage.read = read  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        from cnr_torchrec.ckpt.format.bytes import rows

        rows.RowReader.__init__, Storage.read = self._undo  # type: ignore[method-assign]

    @property
    def nbytes(self) -> int:
        return int(self.stats.get("bytes_read", 0)) + self.files


def selected_bytes(root: str, tables: list[str]) -> int:
    """The stored bytes of ``tables``' entries in the newest chain: what a reader of those tables must read."""
    storage = Storage(root)
    try:
        tip = load_manifest(storage, max(committed_ids(storage)))
        total = 0
        for m in walk_chain(tip, lambda i: load_manifest(storage, i)):
            for report in m.ranks:
                blobs = report.payload.blobs
                for table, entries in report.tables.items():
                    if table in tables:
                        total += sum(blobs[name].nbytes for e in entries for name in e.row_blobs)
        return total
    finally:
        storage.close()


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return slowest(best) * 1e3


def dcp_half(ref, export: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    state = {k: v for k, v in ref.state_dict().items() if any(f".{t}." in k for t in HALF)}
    dcp.load(state, checkpoint_id=export, planner=DefaultLoadPlanner(allow_partial_load=True))


def measure_root(root: str, ref, config, args, rank: int) -> dict:
    from cnr_torchrec.ckpt.tools.dcp import export_dcp

    export = f"{root}-dcp"
    if rank == 0:
        shutil.rmtree(export, ignore_errors=True)
        storage = Storage(root)
        export_dcp(storage, export)
        storage.close()
    dist.barrier()
    with ReadCounter() as counter:
        warm_start(ref, root, tables=HALF)
    read = torch.tensor([counter.nbytes], dtype=torch.int64)
    dist.all_reduce(read)
    out = {"warm_ms": timed(lambda: warm_start(ref, root, tables=HALF), args.repeats),
           "dcp_ms": timed(lambda: dcp_half(ref, export), args.repeats),
           "warm_bytes": int(read), "minimal_bytes": selected_bytes(root, HALF)}
    with Checkpointer(ref, config) as ck:
        out["restore_ms"] = timed(ck.restore, args.repeats)
    if rank == 0:
        shutil.rmtree(export, ignore_errors=True)
    return out


def measure_copy(root: str, args) -> dict:
    from cnr_torchrec.cli import main as cnr

    def durable_copytree(d: str) -> None:
        shutil.copytree(root, d)
        os.sync()  # what it takes to make the plain copy's files durable, as cnr copy makes each checkpoint's

    copies: dict[str, list[float]] = {"cnr_copy_ms": [], "copytree_ms": [], "copytree_sync_ms": []}
    for _ in range(args.repeats):
        for name, fn in (("copytree_ms", lambda d: shutil.copytree(root, d)), ("copytree_sync_ms", durable_copytree),
                         ("cnr_copy_ms", lambda d: cnr(["copy", root, d]))):
            dst = f"{root}-copy"
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            fn(dst)
            copies[name].append((time.perf_counter() - t0) * 1e3)
            shutil.rmtree(dst, ignore_errors=True)
    return {k: min(v) for k, v in copies.items()}


def run_size(size: float, args, rank: int, world: int) -> dict | None:
    rows = max(1, round(REF_ROWS * size))
    specs = [TableSpec(f"t{i}", rows, DIM, "row_wise" if i % 2 == 0 else "table_wise") for i in range(TABLES)]
    dmp, opt = build(specs, world)
    ref, _ = build(specs, world)
    root = os.path.join(args.out_dir, f"x{size:g}")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    config = load_config(os.path.join(REPO, "configs", "consecutive.yaml"), root=root, compaction=None,
                         on_busy="wait", memory_tier="off")
    pooling = pooling_for(rows, args.dirty, args, world)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for k in range(args.deltas + 1):
            train_interval(dmp, opt, specs, args.dirty, k, pooling, args, rank, world)
            ck.save(k + 1).wait()
    copy_only = args.only == "copy"
    chain = {} if copy_only else measure_root(root, ref, config, args, rank)
    folded = f"{root}-folded"
    if rank == 0 and not copy_only:
        shutil.rmtree(folded, ignore_errors=True)
        from cnr_torchrec.cli import main as cnr

        assert cnr(["copy", root, folded]) == 0 and cnr(["compact", folded]) == 0
        storage = Storage(folded)
        for cid in committed_ids(storage)[:-1]:  # only the folded baseline stays
            shutil.rmtree(os.path.join(folded, f"ckpt-{cid:08d}"))
        storage.close()
        os.remove(os.path.join(folded, "index.json"))
    dist.barrier()
    single = {} if copy_only else measure_root(folded, ref, dataclasses.replace(config, root=folded), args, rank)
    copy = measure_copy(root, args) if rank == 0 else {}
    if rank == 0:
        for d in (root, folded):
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    return {"size": size, "mb": TABLES * rows * DIM * 4 / 1e6, "chain": chain, "single": single, "copy": copy} \
        if rank == 0 else None


def summary(cell: dict) -> str:
    lines = []
    for name, what in (("chain", "the default chain (a baseline and deltas)"), ("single", "one folded baseline")):
        c = cell[name]
        if not c:  # --only copy
            continue
        lines.append(f"x{cell['size']:g} ({cell['mb']:.0f} MB), {what}: warm start of half the tables "
                     f"{c['warm_ms']:.0f} ms = {c['warm_ms'] / c['restore_ms']:.2f}x a full restore "
                     f"({c['restore_ms']:.0f} ms), {c['warm_ms'] / c['dcp_ms']:.2f}x DCP's partial load of the same "
                     f"tables ({c['dcp_ms']:.0f} ms); read {c['warm_bytes'] / 1e6:.1f} MB, "
                     f"{c['warm_bytes'] / c['minimal_bytes']:.2f}x the tables' {c['minimal_bytes'] / 1e6:.1f} MB")
    cp = cell["copy"]
    lines.append(f"x{cell['size']:g}: cnr copy {cp['cnr_copy_ms']:.0f} ms = "
                 f"{cp['cnr_copy_ms'] / cp['copytree_ms']:.2f}x shutil.copytree ({cp['copytree_ms']:.0f} ms), "
                 f"{cp['cnr_copy_ms'] / cp['copytree_sync_ms']:.2f}x shutil.copytree then os.sync() "
                 f"({cp['copytree_sync_ms']:.0f} ms)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=lambda v: [float(x) for x in v.split(",")], default=[1.0])
    p.add_argument("--dirty", type=float, default=0.1)
    p.add_argument("--deltas", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps-per-interval", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--min-pooling", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default="/tmp/cnr_bench_warm")
    p.add_argument("--json", default=None)
    p.add_argument("--only", choices=["copy"], default=None,
                   help="time only cnr copy and its peers (the chain is still trained and saved; no warm start)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out_dir, exist_ok=True)
    cells = [c for size in args.sizes if (c := run_size(size, args, rank, world)) is not None]
    for cell in cells:
        print(summary(cell), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": cells}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
