"""Publishing: what a follower reads and spends per committed delta, beside a full export and reload.

Run on 2 ranks:  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/publish.py [--json PATH]
Quick run:       ... benchmarks/publish.py --sizes 1 --dirty 0.01 --deltas 2

The model is benchmarks/scale.py's (the reference model of benchmarks/checkpoint.py: 8 tables x 32 dim, half
row_wise, half table_wise, 211 MB of tables and row-wise Adagrad state per size multiple), trained on exactly
``--dirty`` of each table's rows between two saves (scale.py's ``train_interval``), saved with the default config
(consecutive, adaptive 4-bit, residual coding), compaction off. Rank 0 also runs two followers: one serving every
table into an unsharded float32 state_dict (the training model's names), one into TorchRec's int8 inference
model of the same model (``quantize_inference_model``). After each commit both ranks meet at a barrier, then
rank 0:

- polls the followers: the delta's bytes read (its parts and the payload bytes of the served tables' rows), the
  rows it wrote, the apply time (float and int8), and the lag from the commit (the manifest's time) to served;
- the peers, in the same run: ``cnr export``'s full export of the same checkpoint and its copy into the same
  state_dict (what a server that reloads the whole model does), timed; and ``quantize_inference_model`` of an
  unsharded model holding the exported rows (what a full int8 publish computes), timed;
- a full int8 publish of the same tables, in bytes: every row as TorchRec's int8 row-wise tables hold it
  (``dim`` codes, a 2-byte scale and bias each, rounded up to 16 bytes as FBGEMM's TBE aligns rows).

Then every rank restores the same checkpoint into a second sharded model (the trainer's restore, the
reference), rank 0 broadcasts what both followers serve, and each rank compares its shards: the float rows'
largest difference, and the int8 rows' bytes against FBGEMM's row-wise quantizer run on the restored rows (the
conversion quantize_inference_model makes) and their largest error.

Each figure is the median over the ``--deltas`` deltas of a cell; the errors are the worst of them.
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
from torchrec.inference.modules import quantize_inference_model  # noqa: E402

from cnr_torchrec import Checkpointer, load_config  # noqa: E402
from cnr_torchrec.ckpt.format.bytes.storage import Storage  # noqa: E402
from cnr_torchrec.ckpt.tools.export import export_state_dict  # noqa: E402
from cnr_torchrec.publish import Follower  # noqa: E402
from examples.toy import TableSpec, ToyModel  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def int8_row_bytes(dim: int) -> int:
    """A row of an int8 row-wise TBE table: ``dim`` codes and a 4-byte fp16 scale and bias, 16-byte aligned."""
    return -(-(dim + 4) // 16) * 16


def run_cell(dmp, ref, opt, specs, size: float, frac: float, args, rank: int, world: int,
             with_int8: bool) -> dict | None:
    root = os.path.join(args.out_dir, f"x{size:g}-d{frac:g}")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    config = load_config(os.path.join(REPO, "configs", "consecutive.yaml"), root=root, compaction=None,
                         on_busy="wait", memory_tier="off")
    pooling = max(pooling_for(s.rows, frac, args, world) for s in specs)
    out: dict = {"size": size, "dirty": frac, "deltas": []}
    float_f = int8_f = target = quant = None
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck, Checkpointer(ref, config) as restorer:
        for k in range(args.deltas + 1):
            train_interval(dmp, opt, specs, frac, k, pooling, args, rank, world)
            info = ck.save(k + 1).wait()
            dist.barrier()
            if rank == 0 and float_f is None:  # the first checkpoint: the followers load it
                target = {n: torch.zeros(s.rows, DIM) for s, n in zip(specs, _fqns(root, specs))}
                float_f = Follower(root, target)
                out["first_load_ms"] = float_f.poll()[0].apply_ms
                if with_int8:
                    quant = quantize_inference_model(ToyModel(specs, device="cpu"))
                    int8_f = Follower(root, quant)
                    int8_f.poll()
                continue
            if k == 0:
                continue
            cell = _delta(float_f, int8_f, target, specs, root, info) if rank == 0 else {}
            restorer.restore()  # the reference: the trainer's restore of the same checkpoint, on every rank
            cell.update(_errors(float_f, quant, ref, specs, rank, with_int8))
            if rank == 0:
                out["deltas"].append(cell)
    for f in (float_f, int8_f):
        if f is not None:
            f.close()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    if rank != 0:
        return None
    int8 = sum(s.rows * int8_row_bytes(DIM) for s in specs)
    med = {k: statistics.median(d[k] for d in out["deltas"]) for k in out["deltas"][0] if k != "ckpt"}
    errors = [k for k in ("float_max_error", "int8_max_error", "int8_bytes_differing") if k in out["deltas"][0]]
    out.update(median=med, worst={k: max(d[k] for d in out["deltas"]) for k in errors}, int8_publish_bytes=int8,
               int8_over_read=int8 / med["bytes_read"], apply_over_export=med["apply_ms"] / med["export_reload_ms"],
               read_over_checkpoint=med["bytes_read"] / med["checkpoint_bytes"])
    if with_int8:
        out["int8_apply_over_quantize"] = med["int8_apply_ms"] / med["quantize_ms"]
    return out


def _delta(float_f: Follower, int8_f: Follower | None, target: dict, specs, root: str, info) -> dict:
    """Rank 0: the followers poll the delta just committed; the peers (a full export and reload, and
    TorchRec's quantize_inference_model of a model holding the restored rows) are timed beside them."""
    (update,) = float_f.poll()
    assert update.how == "delta", update
    storage = Storage(root)
    t0 = time.perf_counter()
    full = export_state_dict(storage, info.id)
    for name, t in target.items():
        t.copy_(full[name])
    peer_ms = (time.perf_counter() - t0) * 1e3
    storage.close()
    cell = {"ckpt": update.ckpt, "bytes_read": update.bytes_read, "rows": update.rows, "apply_ms": update.apply_ms,
            "lag_s": update.lag_s, "export_reload_ms": peer_ms, "checkpoint_bytes": info.nbytes}
    if int8_f is None:
        return cell
    (int8_update,) = int8_f.poll()
    assert int8_update.how == "delta", int8_update
    model = ToyModel(specs, device="cpu")
    with torch.no_grad():
        for name, w in model.state_dict(keep_vars=True).items():
            if name in full:
                w.copy_(full[name])
    t0 = time.perf_counter()
    quantize_inference_model(model)
    quantize_ms = (time.perf_counter() - t0) * 1e3
    return cell | {"int8_apply_ms": int8_update.apply_ms, "quantize_ms": quantize_ms}


def _errors(float_f: Follower | None, quant, ref, specs, rank: int, with_int8: bool) -> dict:
    """Every rank: the served rows (broadcast by rank 0) against its shards of the trainer's restore: the float
    copy's largest difference, the int8 rows' bytes that differ from FBGEMM's row-wise quantizer run on the
    restored rows (the conversion TorchRec's quantize_inference_model makes), and their largest error."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    from cnr_torchrec.publish.targets import quantize_rows

    int8_rows = {}
    if rank == 0 and with_int8:
        for m in quant.modules():
            if isinstance(m, IntNBitTableBatchedEmbeddingBagsCodegen):
                for (t, *_), (w, _) in zip(m.embedding_specs, m.split_embedding_weights(split_scale_shifts=False)):
                    int8_rows[t] = w
    worst = torch.zeros(3, dtype=torch.float64)
    tracker = ref.dirty_tracker
    for s in specs:
        served = float_f.served_rows[s.name].contiguous() if rank == 0 else torch.empty(s.rows, DIM)
        dist.broadcast(served, 0)
        if with_int8:
            held = int8_rows[s.name].contiguous() if rank == 0 else torch.empty(s.rows, int8_row_bytes(DIM),
                                                                                  dtype=torch.uint8)
            dist.broadcast(held, 0)
        for kernel, shard in tracker.shards(s.name):
            (r0, r1), (c0, c1) = shard.rows, shard.cols
            restored = kernel.tbe.split_embedding_weights()[shard.local_index].detach()
            worst[0] = max(worst[0], float((served[r0:r1, c0:c1] - restored).abs().max()))
            if not with_int8:
                continue
            fused = quantize_rows(restored.float(), 8)  # codes, then the fp16 scale and bias
            mine = held[r0:r1]
            differ = int((mine[:, 4 : 4 + DIM] != fused[:, :DIM]).sum() + (mine[:, :4] != fused[:, DIM:]).sum())
            back = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, 8)
            worst[1] = max(worst[1], float((back - restored).abs().max()))
            worst[2] += differ
    dist.all_reduce(worst[:2], op=dist.ReduceOp.MAX)
    dist.all_reduce(worst[2:])
    if not with_int8:
        return {"float_max_error": float(worst[0])}
    return {"float_max_error": float(worst[0]), "int8_max_error": float(worst[1]),
            "int8_bytes_differing": int(worst[2])}


def _summary(cell: dict, rows: int) -> str:
    m, worst = cell["median"], cell["worst"]
    line = (f"x{cell['size']:g} ({TABLES * rows * DIM * 4 / 1e6:.0f} MB of float tables), dirty {cell['dirty']:g}: a "
            f"delta read {m['bytes_read'] / 1e6:.2f} MB ({cell['read_over_checkpoint']:.2f}x its checkpoint's "
            f"{m['checkpoint_bytes'] / 1e6:.2f} MB), wrote {m['rows']:,.0f} rows in {m['apply_ms']:.0f} ms "
            f"({cell['apply_over_export']:.3f}x the {m['export_reload_ms']:.0f} ms of a full export and reload), "
            f"served {m['lag_s']:.2f} s after its commit; a full int8 publish is "
            f"{cell['int8_publish_bytes'] / 1e6:.1f} MB, {cell['int8_over_read']:.1f}x the delta's bytes. Against the "
            f"trainer's restore, worst of the deltas: float rows off by {worst['float_max_error']:g}")
    if "int8_apply_ms" in m:
        line += (f". int8 target: {m['int8_apply_ms']:.0f} ms ({cell['int8_apply_over_quantize']:.3f}x the "
                 f"{m['quantize_ms']:.0f} ms of quantize_inference_model on the restored model); its rows "
                 f"{worst['int8_bytes_differing']} bytes from FBGEMM's quantizer on the restored rows, off by "
                 f"{worst['int8_max_error']:.3g}")
    return line


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
    p.add_argument("--int8-sizes", type=lambda v: [float(x) for x in v.split(",")], default=[1.0],
                   help="the sizes at which an int8 follower and its peer run too (default 1: at 10x the machine's "
                        "24 GB do not hold both followers, the peers and two sharded models)")
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
        ref, _ = build(specs, world)  # the trainer's restore of each checkpoint goes here
        for frac in args.dirty:
            cell = run_cell(dmp, ref, opt, specs, size, frac, args, rank, world, size in args.int8_sizes)
            if cell is not None:
                cells.append(cell)
                print(_summary(cell, rows), flush=True)
        del dmp, ref, opt
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": cells}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
