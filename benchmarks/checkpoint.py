"""Checkpoint size, stall and restore time: each Checkpointer policy vs torchsnapshot and DCP.

Run on 2 ranks:  torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint.py [--json PATH]
On GPUs:         torchrun --standalone --nproc_per_node N benchmarks/checkpoint.py --device cuda (the model on
                 cuda:LOCAL_RANK, NCCL beside gloo; docs/gpu.md has one H200's figures)
Quick run:       ... benchmarks/checkpoint.py --rows 20000 --batch-size 256 --steps-per-interval 1 --reps 2
(about 1.5 minutes on the 2-core dev VM; the quick run, 20 s. Checkpoints go under --out-dir,
one fresh directory per policy, wiped at the end unless --keep.)

Workload (issue 2): 8 tables x 200k rows x 32 dim, half row_wise and half table_wise,
batch 2048 per rank, pooling 20, Zipf(1.05) ids, EXACT_ROWWISE_ADAGRAD (lr 0.01), gloo
on CPU. Every policy gets a freshly built model (same seed) and the same batches, so
each one checkpoints exactly the same sequence of model states: ``--steps-per-interval``
training steps, a save (the baseline), then ``--intervals`` times more steps and a save.
Saves are not waited for: training goes on while the background thread writes.
The interval decides the dirty fraction, and so every size figure: here each step touches
~10% of a table's rows, so 4 steps dirty ~27% of them per interval, 8 steps ~42%, and from
~16 steps (>= 50%, ``full_shard_fraction``) the tables are written whole. Default: 4.

Policies: full, one_shot, consecutive and intermittent at 4-bit adaptive with compact
storage (float16 row bias, bfloat16 optimizer row state), consecutive with the exact
defaults (float32 bias and state), consecutive without quantization (fp32 rows), and
``default``: the CheckpointConfig a user gets without choosing anything.
Per checkpoint: id, kind, bytes written by all ranks, blocking (stall) ms and background
(encode + write) ms, both the slowest rank's, and the dirty fraction (rows written / rows
of all tables; a table whose dirty share reaches ``full_shard_fraction`` is written whole,
and counts whole). Also: what the latest
checkpoint of each policy is made of (row ids, quantized payload, per-row scale/bias,
optimizer state, dense, RNG), from its manifest.

Peers, on the model state of the last consecutive 4-bit checkpoint: torchsnapshot
``Snapshot.take(path, {"model": dmp})`` and ``torch.distributed.checkpoint.save`` of
``{"model": dmp.state_dict()}`` (time: median of ``--reps`` of the slowest rank; bytes:
every file of the snapshot, via os.walk), and ``dcp.load`` into ``dmp.state_dict()``
against ``Checkpointer.restore()`` of the baseline + deltas chain, in alternating rounds.
Note the peers save what DMP's state_dict holds (embedding weights, dense parameters),
while our checkpoints also hold the fused optimizer's state and the dense optimizer.

Figures per policy (``--json`` writes them, with the raw bytes and ms):
  bytes_ratio_vs_torchsnapshot: snapshot bytes / our bytes per checkpoint (median over
      the deltas; over every checkpoint for ``full``, which writes only baselines);
  capacity_ratio_chain: 10 snapshots' bytes / everything the policy wrote for its
      baseline and ``--intervals`` checkpoints (what keeping that history costs on disk);
  stall_ratio_vs_torchsnapshot: our median stall over all checkpoints / snapshot take time;
  restore_ratio_vs_dcp: time to restore the policy's latest checkpoint / DCP load time.
Targets (consecutive, 4-bit adaptive): bytes_ratio >= 20, stall_ratio <= 0.05, restore_ratio <= 1.0
(1.5 before issue 28); consecutive_fp32's restore_ratio <= 1.5; and default's bytes_ratio >= 25
(issue 29).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.types import ShardingEnv

from cnr_torchrec import CheckNRunDMP, Checkpointer, load_config
from cnr_torchrec.ckpt.restore.stats import PHASES

# The repository root, for the example job and models (cnr_dlrm, examples), which are not in the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.toy import TableSpec, ToyModel, build_plan, sharders_for, zipf_batch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dist import add_device_argument, init_process_group, sync  # noqa: E402

# (label, policy, quantization); the reference is the one the targets are for. "Compact" storage:
# row biases in float16 and the optimizer's row state in bfloat16 (configs/consecutive.yaml), 4 bytes
# less per dirty row than the exact defaults (float32 bias and state), which "consecutive_exact" shows.
# The named rows code plainly (residual: false); "default" takes residual: auto, which codes residuals here.
COMPACT = {"params": {"bias_dtype": "float16"}, "state_dtype": "bfloat16", "residual": False}
POLICIES = [
    ("full", "full", {"method": "adaptive", "bits": 4, **COMPACT}),
    ("one_shot", "one_shot", {"method": "adaptive", "bits": 4, **COMPACT}),
    ("consecutive", "consecutive", {"method": "adaptive", "bits": 4, **COMPACT}),
    ("intermittent", "intermittent", {"method": "adaptive", "bits": 4, **COMPACT}),
    ("consecutive_exact", "consecutive", {"method": "adaptive", "bits": 4, "residual": False}),
    ("consecutive_fp32", "consecutive", {"method": "none"}),
    ("default", None, None),  # the CheckpointConfig a user gets without choosing (issue 29)
    ("default_no_images", None, None),  # the same with memory_tier: off, the peer of the images' cost (issue 41)
]
REFERENCE = "consecutive"
TARGETS = {"bytes_ratio_vs_torchsnapshot": (">=", 20.0), "stall_ratio_vs_torchsnapshot": ("<=", 0.05),
           "restore_ratio_vs_dcp": ("<=", 1.0)}  # restore: 1.5 until issue 28
# Other policies' targets, judged when they run: fp32 rows restore within 1.5x DCP (issue 28); the default
# config's deltas are at least 25x smaller than a full snapshot (issue 29).
POLICY_TARGETS = {"consecutive_fp32": {"restore_ratio_vs_dcp": ("<=", 1.5)},
                  "default": {"bytes_ratio_vs_torchsnapshot": (">=", 25.0)}}


def build(specs, world: int, device: torch.device = torch.device("cpu"), times: dict | None = None,
          will_restore: object = False):
    """The reference model sharded over ``world`` ranks and its dense optimizer; ``times`` (if given) gets the
    seconds of its parts: the unsharded module (``module_s``), the sharding plan (``plan_s``) and the sharded
    model (``shard_s``: TorchRec's DMP, which allocates and fills this rank's shards). ``will_restore``: as
    CheckNRunDMP takes it (the tables' initial values are drawn only if a restore does not overwrite them)."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = ToyModel(specs)
    t1 = time.perf_counter()
    sharders = sharders_for(EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.01)
    plan = build_plan(model, sharders, world, device_type=device.type)
    t2 = time.perf_counter()
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = CheckNRunDMP(model, env=env, device=device, plan=plan, sharders=sharders, will_restore=will_restore)
    opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "dense" in n], lr=0.01)
    if times is not None:
        times.update(module_s=t1 - t0, plan_s=t2 - t1, shard_s=time.perf_counter() - t2)
    return dmp, opt


def step(dmp, opt, batch) -> None:
    loss = dmp(batch)
    loss.backward()
    opt.step()
    opt.zero_grad()


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def total(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def timed(fn) -> float:
    """Wall time of ``fn()`` on the slowest rank, in ms, queued GPU work included; all ranks start together."""
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return slowest((time.perf_counter() - t0) * 1e3)



def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def local_weights(dmp) -> list[torch.Tensor]:
    """Copies of this rank's embedding shards and dense parameters, to check what a restore brought back."""
    tracker = dmp.dirty_tracker
    out = []
    for t in tracker.tables():
        for kernel, shard in tracker.shards(t):
            out.append(kernel.tbe.split_embedding_weights()[shard.local_index].detach().clone())
    out += [p.detach().clone() for n, p in dmp.named_parameters() if "dense" in n]
    return out


def max_error(dmp, ref: list[torch.Tensor]) -> float:
    err = max((float((a - b).abs().max()) for a, b in zip(local_weights(dmp), ref) if a.numel()), default=0.0)
    return slowest(err)


def fresh_dir(path: str, rank: int) -> str:
    """Rank 0 (re)creates ``path``; every rank returns once it exists."""
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    return path


def run_policy(label, policy, quant, specs, args, rank, world, root, device):
    """Trains a fresh model and checkpoints it with one policy (None: the config's defaults, quantization
    included). Returns (dmp, opt, config, per-checkpoint rows, the quantization the Checkpointer ran: the config's
    with its defaults settled for the job)."""
    dmp, opt = build(specs, world, device)
    # A named row is its policy alone (compaction off); the default row is what a user gets, its fold included.
    default = {"root": root, **({"memory_tier": "off"} if label == "default_no_images" else {})}
    config = load_config(default if policy is None else {"root": root, "policy": policy, "quantization": quant,
                                                         "compaction": None})
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    gen = torch.Generator().manual_seed(1000 + rank)  # same batches for every policy
    handles, dirty = [], []
    n_step = 0
    for _ in range(args.intervals + 1):
        for _ in range(args.steps_per_interval):
            step(dmp, opt, zipf_batch(specs, args.batch_size, args.pooling, gen).to(dmp.device))
            n_step += 1
        counts = dmp.dirty_tracker.dirty_counts()  # since the previous save, before this one resets it
        dirty.append(total(sum(counts.values())))
        handles.append(ck.save(n_step))
    ck.wait()
    ck.close()
    ran = ck.config.quantization
    total_rows = len(specs) * args.rows
    kept = set(committed_ids_of(root)) if rank == 0 else set()
    rows = []
    for h, d in zip(handles, dirty):
        info = h.wait()
        rows.append({
            "id": info.id, "step": info.step, "kind": info.kind, "nbytes": info.nbytes,
            "stall_ms": info.stall_ms, "write_ms": info.write_ms, "rows_written": info.rows_written,
            "dirty_fraction": info.rows_written / total_rows, "dirty_since_previous_fraction": d / total_rows,
        })
        if rank == 0:  # None: retention has collected it by now (full keeps its newest baselines only)
            rows[-1]["stored_whole"], rows[-1]["row_mode_bytes"] = (row_modes(root, info.id) if info.id in kept
                                                                    else (None, 0))
    return dmp, opt, config, rows, ran


def committed_ids_of(root: str) -> list[int]:
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids

    storage = Storage(root)
    try:
        return committed_ids(storage)
    finally:
        storage.close()


def row_modes(root: str, ckpt_id: int) -> tuple[float, int]:
    """Of checkpoint ``ckpt_id``: the share of the rows it wrote that it stores whole (every row of a plain entry,
    the rows a residual entry's row-mode bitmap marks), and the bytes of those bitmaps."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import load_manifest

    storage = Storage(root)
    try:
        m = load_manifest(storage, ckpt_id)
    finally:
        storage.close()
    entries = [e for _, _, e in m.entries()]
    stored = sum(e.num_stored for e in entries)
    whole = sum(e.num_stored if not e.residual else e.whole.count if e.whole is not None else 0 for e in entries)
    bitmaps = sum(r.blobs[e.whole.blob].nbytes for r in m.ranks for es in r.tables.values() for e in es
                  if e.whole is not None)
    return (whole / stored if stored else 1.0), bitmaps


def bytes_breakdown(root: str) -> dict[str, int]:
    """What the latest checkpoint under ``root`` is made of, in bytes, from its manifest's blob index."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest, manifest_path

    storage = Storage(root)
    try:
        cid = committed_ids(storage)[-1]
        m = load_manifest(storage, cid)
    finally:
        storage.close()
    out = {"id": cid, "ids": 0, "row_crcs": 0, "row_modes": 0, "weights_payload": 0, "weights_scale_bias_codebook": 0,
           "optimizer_state": 0, "replicated_tables": 0, "dense": 0, "dense_optimizer": 0, "rng_and_extra": 0}
    for r in m.ranks:
        for name, blob in r.blobs.items():
            head, _, rest = name.partition("/")
            if head.startswith("s") and head[1:].isdigit():
                key = ("ids" if rest == "ids" else "row_crcs" if rest == "crc32c" else "row_modes" if rest == "whole"
                       else "weights_payload" if rest == "w/payload"
                       else "weights_scale_bias_codebook" if rest.startswith("w/") else "optimizer_state")
            else:
                key = {"rep": "replicated_tables", "dense": "dense", "dense_optimizer": "dense_optimizer"}.get(
                    head, "rng_and_extra")
            out[key] += blob.nbytes
    out["payload_files"] = m.nbytes
    out["manifest_json"] = os.path.getsize(os.path.join(root, manifest_path(cid)))
    return out


BREAKDOWN = (*PHASES, "bytes_read", "reads", "minimal_bytes")
SUMMED = ("bytes_read", "reads", "minimal_bytes")  # over the ranks; the phases: their slowest rank


def restore_ms(dmp, opt, config, breakdowns: list | None = None) -> float:
    """Time of ``Checkpointer.restore()`` of the latest checkpoint under ``config.root``, by a new Checkpointer.
    ``breakdowns`` gets where that restore's time went: each phase's slowest rank (bytes and reads: all ranks')."""
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    try:
        ms = timed(ck.restore)
        stats = ck.last_restore_stats
    finally:
        ck.close()
    if breakdowns is not None:
        breakdowns.append({k: (total if k in SUMMED else slowest)(stats.get(k, 0))
                           for k in BREAKDOWN})
    return ms


def median_breakdown(breakdowns: list) -> dict[str, float]:
    return {k: statistics.median(b[k] for b in breakdowns) for k in BREAKDOWN}


def breakdown_line(b: dict[str, float]) -> str:
    return (f"resolve {b['resolve_ms']:.0f} (manifests {b['manifests_ms']:.0f}), check {b['check_ms']:.0f}, "
            f"rollback copy {b['snapshot_ms']:.0f}, host copies {b['stage_ms']:.0f}, plan "
            f"{b['plan_ms']:.0f}, apply {b['apply_ms']:.0f} (waiting for reads {b['read_wait_ms']:.0f}), dense and "
            f"per-rank state {b['state_ms']:.0f}, agree {b['agree_ms']:.0f}, residual reconstruction "
            f"{b['reconstruction_ms']:.0f} ms; read {b['bytes_read'] / 1e6:.1f} MB "
            f"in {b['reads']:.0f} requests, {b['bytes_read'] / max(b['minimal_bytes'], 1):.2f}x the "
            f"{b['minimal_bytes'] / 1e6:.1f} MB of the rows applied")


class LocalShards:
    """Fallback app state for torchsnapshot: this rank's embedding shards and dense parameters as plain tensors.

    Used only if ``Snapshot.take(path, {"model": dmp})`` fails (or with --snapshot-state local):
    the same bytes of model state, without the ShardedTensor metadata.
    """

    def __init__(self, dmp) -> None:
        self.dmp = dmp

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        tracker = self.dmp.dirty_tracker
        for t in tracker.tables():
            for i, (kernel, shard) in enumerate(tracker.shards(t)):
                out[f"{t}/{i}"] = kernel.tbe.split_embedding_weights()[shard.local_index].detach()
        out.update({n: p.detach() for n, p in self.dmp.named_parameters() if "dense" in n})
        return out

    def load_state_dict(self, sd) -> None:
        raise NotImplementedError("only saved, for its time and size")


def quiet_disk(rank: int) -> None:
    """Flushes earlier writes (ours included) so that they do not slow the next timed peer save."""
    if rank == 0:
        os.sync()
    dist.barrier()


def peers(dmp, opt, config, args, rank, out_dir):
    """torchsnapshot and DCP on the current model state, and restore of ours vs DCP load."""
    import torch.distributed.checkpoint as dcp
    from torchsnapshot import Snapshot

    res: dict = {}
    ref = local_weights(dmp)
    state = {"dmp": ('{"model": dmp}', dmp), "local": ('{"model": LocalShards(dmp)}', LocalShards(dmp))}
    app_name, app = state[args.snapshot_state]
    snap = {"app_state": app_name, "take_ms_all": [], "nbytes": None}
    dcp_path = os.path.join(out_dir, "dcp")
    dcp_res = {"save_ms_all": []}
    # Rounds of one torchsnapshot take and one DCP save, so that machine noise hits both alike;
    # the last DCP checkpoint is kept for the load rounds.
    for r in range(args.reps):
        path = os.path.join(out_dir, f"torchsnapshot_{r}")
        quiet_disk(rank)
        try:
            snap["take_ms_all"].append(timed(lambda: Snapshot.take(path, {"model": app})))
        except Exception as e:
            if app_name.startswith('{"model": LocalShards'):
                raise
            if rank == 0:
                print(f"torchsnapshot Snapshot.take(path, {app_name}) failed: {type(e).__name__}: {e}; "
                      "falling back to LocalShards (the ranks' embedding shards and dense parameters as tensors)")
            snap["error_with_dmp"] = f"{type(e).__name__}: {e}"
            app_name, app = state["local"]
            snap["app_state"] = app_name
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            snap["take_ms_all"].append(timed(lambda: Snapshot.take(path, {"model": app})))
        dist.barrier()
        if snap["nbytes"] is None:
            snap["nbytes"] = total(dir_bytes(path) if rank == 0 else 0)  # rank 0 sees the whole directory
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        fresh_dir(dcp_path, rank)
        quiet_disk(rank)
        dcp_res["save_ms_all"].append(timed(lambda: dcp.save({"model": dmp.state_dict()}, checkpoint_id=dcp_path)))
    dist.barrier()
    snap["take_ms"] = statistics.median(snap["take_ms_all"])
    dcp_res["save_ms"] = statistics.median(dcp_res["save_ms_all"])
    dcp_res["nbytes"] = total(dir_bytes(dcp_path) if rank == 0 else 0)
    res["torchsnapshot"], res["dcp"] = snap, dcp_res

    # Restore rounds: ours (whole chain, new Checkpointer) then DCP load (back to exact fp32), alternating.
    ours, theirs, breakdowns = [], [], []
    for _ in range(args.reps):
        ours.append(restore_ms(dmp, opt, config, breakdowns))
        ours_err = max_error(dmp, ref)

        def load():
            sd = dmp.state_dict()
            dcp.load({"model": sd}, checkpoint_id=dcp_path)

        theirs.append(timed(load))
        dcp_err = max_error(dmp, ref)
    res["dcp"].update(load_ms=statistics.median(theirs), load_ms_all=theirs, load_max_abs_error=dcp_err)
    res["ours_restore"] = {"restore_ms": statistics.median(ours), "restore_ms_all": ours,
                           "max_abs_error": ours_err, "breakdown": median_breakdown(breakdowns)}
    if rank == 0:
        shutil.rmtree(dcp_path, ignore_errors=True)
    return res


def figures(rows, snap_bytes, snap_ms, snap_ms_min, dcp_load_ms, restore, intervals):
    deltas = [r["nbytes"] for r in rows if r["kind"] == "delta"] or [r["nbytes"] for r in rows]
    per_ckpt = statistics.median(deltas)
    written = sum(r["nbytes"] for r in rows)
    stall = statistics.median(r["stall_ms"] for r in rows)
    return {
        "median_bytes_per_checkpoint": per_ckpt,
        "total_bytes_written": written,
        "median_stall_ms": stall,
        "median_write_ms": statistics.median(r["write_ms"] for r in rows),
        "restore_ms": restore,
        "bytes_ratio_vs_torchsnapshot": snap_bytes / per_ckpt if snap_bytes else None,
        # Capacity: what keeping this history costs on disk, i.e. everything written (for
        # one_shot a restore reads only the baseline and the latest delta, but all of them were written).
        "capacity_ratio_chain": intervals * snap_bytes / written if snap_bytes else None,
        "stall_ratio_vs_torchsnapshot": stall / snap_ms if snap_ms else None,
        # The take time swings several-fold on this shared VM; against its fastest rep, for a conservative view.
        "stall_ratio_vs_fastest_take": stall / snap_ms_min if snap_ms_min else None,
        "restore_ratio_vs_dcp": restore / dcp_load_ms if dcp_load_ms else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps-per-interval", type=int, default=4, help="training steps between saves")
    parser.add_argument("--intervals", type=int, default=10, help="checkpoints after the baseline")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each peer measurement and restore")
    parser.add_argument("--snapshot-state", choices=["dmp", "local"], default="dmp",
                        help="torchsnapshot app state: the DMP itself, or LocalShards (the fallback)")
    parser.add_argument("--policies", type=str, default=",".join(p[0] for p in POLICIES))
    parser.add_argument("--out-dir", type=str, default="/tmp/cnr_bench_checkpoint",
                        help="scratch directory (wiped at start and end); one subdirectory per policy")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoints in --out-dir")
    parser.add_argument("--log-level", type=str, default="WARNING", help="level of cnr_torchrec's log")
    parser.add_argument("--json", type=str, default=None)
    add_device_argument(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("cnr_torchrec").setLevel(args.log_level.upper())
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torchsnapshot").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    t_start = time.perf_counter()
    device = init_process_group(args.device, parser)
    rank, world = dist.get_rank(), dist.get_world_size()
    specs = [TableSpec(f"t{i}", args.rows, args.dim, "row_wise" if i % 2 == 0 else "table_wise")
             for i in range(args.tables)]
    chosen = [p for p in POLICIES if p[0] in args.policies.split(",")]
    if REFERENCE not in [p[0] for p in chosen]:
        raise SystemExit(f"--policies must include {REFERENCE!r}: the peers are measured on its model state")
    fresh_dir(args.out_dir, rank)

    runs, peer, restores, breakdowns, restore_breakdowns = {}, None, {}, {}, {}
    for label, policy, quant in chosen:
        root = fresh_dir(os.path.join(args.out_dir, label), rank)
        dmp, opt, config, rows, ran = run_policy(label, policy, quant, specs, args, rank, world, root, device)
        runs[label] = rows
        breakdowns[label] = bytes_breakdown(root) if rank == 0 else {}
        if rank == 0:
            print(f"\npolicy {label} ({config.policy}, {ran})")
            print(f"{'policy':<18s}{'id':>4s}{'step':>6s}  {'kind':<9s}{'bytes':>13s}{'stall ms':>10s}"
                  f"{'write ms':>10s}{'dirty':>8s}{'whole':>8s}")
            for r in rows:
                print(f"{label:<18s}{r['id']:>4d}{r['step']:>6d}  {r['kind']:<9s}{r['nbytes']:>13,d}"
                      f"{r['stall_ms']:>10.1f}{r['write_ms']:>10.1f}{r['dirty_fraction']:>8.2%}"
                      + (f"{r['stored_whole']:>8.1%}" if r["stored_whole"] is not None else f"{'gone':>8s}"),
                      flush=True)
            print("whole: the share of the rows written that are stored whole (the rest: residuals); gone: "
                  "collected by retention before it was read")
        if label == REFERENCE:
            peer = peers(dmp, opt, config, args, rank, args.out_dir)
            restores[label] = peer["ours_restore"]["restore_ms"]
            restore_breakdowns[label] = peer["ours_restore"]["breakdown"]
        else:
            found: list = []
            restores[label] = statistics.median(restore_ms(dmp, opt, config, found) for _ in range(args.reps))
            restore_breakdowns[label] = median_breakdown(found)
        del dmp, opt

    snap = peer["torchsnapshot"]
    snap_bytes, snap_ms = snap.get("nbytes"), snap.get("take_ms")
    snap_ms_min = min(snap["take_ms_all"], default=None)
    dcp_load = peer["dcp"]["load_ms"]
    figs = {label: figures(rows, snap_bytes, snap_ms, snap_ms_min, dcp_load, restores[label],
                              args.intervals)
            for label, rows in runs.items()}
    elapsed = slowest(time.perf_counter() - t_start)

    if rank == 0:
        print(f"\n{world} ranks on {args.device}, {args.tables} tables x {args.rows} rows x {args.dim}, "
              f"batch {args.batch_size}/rank, pooling {args.pooling}; baseline + {args.intervals} checkpoints, "
              f"{args.steps_per_interval} steps apart; medians of {args.reps} reps")
        if "error_with_dmp" in snap:
            print(f"torchsnapshot take {{'model': dmp}} failed ({snap['error_with_dmp']}); figures below use the "
                  "fallback LocalShards: each rank's embedding shards and dense parameters as plain tensors")
        print(f"torchsnapshot take {snap['app_state']}: {snap_bytes:,d} bytes, {snap_ms:.0f} ms "
              f"(all: {', '.join(f'{t:.0f}' for t in snap['take_ms_all'])})")
        d = peer["dcp"]
        print(f"DCP save {{'model': dmp.state_dict()}}: {d['nbytes']:,d} bytes, {d['save_ms']:.0f} ms "
              f"(all: {', '.join(f'{t:.0f}' for t in d['save_ms_all'])}); load {d['load_ms']:.0f} ms "
              f"(all: {', '.join(f'{t:.0f}' for t in d['load_ms_all'])}; max |error| after load "
              f"{d['load_max_abs_error']:.2g})")
        o = peer["ours_restore"]
        print(f"Checkpointer.restore() of the {REFERENCE} chain (baseline + {args.intervals} deltas): "
              f"{o['restore_ms']:.0f} ms (all: {', '.join(f'{t:.0f}' for t in o['restore_ms_all'])}; "
              f"max |error| {o['max_abs_error']:.2g}: quantization)")
        print(f"\n{'policy':<18s}{'bytes/ckpt':>13s}{'total bytes':>14s}{'stall ms':>10s}{'write ms':>10s}"
              f"{'restore ms':>12s}{'bytes x':>9s}{'capacity x':>12s}{'stall x':>9s}{'restore x':>11s}")
        for label, f in figs.items():
            def fmt(v, spec):
                return format(v, spec) if v is not None else "n/a".rjust(int(spec.split(".")[0]))
            print(f"{label:<18s}{f['median_bytes_per_checkpoint']:>13,.0f}{f['total_bytes_written']:>14,d}"
                  f"{f['median_stall_ms']:>10.1f}{f['median_write_ms']:>10.1f}{f['restore_ms']:>12.0f}"
                  f"{fmt(f['bytes_ratio_vs_torchsnapshot'], '9.1f')}{fmt(f['capacity_ratio_chain'], '12.2f')}"
                  f"{fmt(f['stall_ratio_vs_torchsnapshot'], '9.3f')}{fmt(f['restore_ratio_vs_dcp'], '11.2f')}")
        if snap_bytes:
            print(f"{'torchsnapshot':<18s}{snap_bytes:>13,d}{args.intervals * snap_bytes:>14,d}{snap_ms:>10.1f}")
        print(f"{'DCP':<18s}{d['nbytes']:>13,d}{args.intervals * d['nbytes']:>14,d}{d['save_ms']:>10.1f}"
              f"{'':>10s}{d['load_ms']:>12.0f}")
        print("bytes x = snapshot bytes / our median bytes per checkpoint (deltas); capacity x = "
              f"{args.intervals} snapshots / all we wrote for baseline + {args.intervals}; stall x = our median "
              "stall / snapshot take; restore x = our restore of the latest checkpoint / DCP load")
        print(f"\ntargets for {REFERENCE} (4-bit adaptive):")
        met = {}
        judged = {REFERENCE: TARGETS, **{p: t for p, t in POLICY_TARGETS.items() if p in figs}}
        for label, targets in judged.items():
            met[label] = {}
            for key, (op, bound) in targets.items():
                v = figs[label][key]
                ok = v is not None and (v >= bound if op == ">=" else v <= bound)
                met[label][key] = ok
                shown = "n/a" if v is None else f"{v:.3f}"
                name = key if label == REFERENCE else f"{key} ({label})"
                print(f"  {name:<30s} {shown:>8s}  target {op} {bound:<5g} {'met' if ok else 'NOT met'}")
        f = figs[REFERENCE]
        print(f"  (stall against the fastest take, {snap_ms_min:.0f} ms: {f['stall_ratio_vs_fastest_take']:.3f}; "
              f"median stall {f['median_stall_ms']:.1f} ms)")
        print(f"dirty fraction per interval ({REFERENCE}): "
              + ", ".join(f"{r['dirty_fraction']:.1%}" for r in runs[REFERENCE][1:]))
        deltas = [r for r in runs.get("default", ()) if r["kind"] == "delta" and r["stored_whole"] is not None]
        if deltas:  # the default codes residuals: each row whole or as a residual
            modes, delta_bytes = sum(r["row_mode_bytes"] for r in deltas), sum(r["nbytes"] for r in deltas)
            print("rows stored whole per interval (default): "
                  + ", ".join(f"{r['stored_whole']:.1%}" for r in deltas)
                  + f"; row-mode bitmaps {modes:,d} of the deltas' {delta_bytes:,d} bytes ({modes / delta_bytes:.2%})")
        if "default" in figs and "default_no_images" in figs:  # the memory tier's cost to a save and a restore
            on, off = figs["default"], figs["default_no_images"]
            print(f"memory images (default against default_no_images, memory_tier: off): median stall "
                  f"{on['median_stall_ms']:.1f} ms against {off['median_stall_ms']:.1f} ms "
                  f"({on['median_stall_ms'] / off['median_stall_ms']:.3f}x); restore from storage "
                  f"{restores['default']:.0f} ms against {restores['default_no_images']:.0f} ms "
                  f"({restores['default'] / restores['default_no_images']:.3f}x)")
        parts = ["ids", "row_crcs", "row_modes", "weights_payload", "weights_scale_bias_codebook", "optimizer_state",
                 "replicated_tables", "dense", "dense_optimizer", "rng_and_extra", "manifest_json"]
        print("\nbytes of each policy's latest checkpoint, by part (payload files; the manifest is written besides):")
        heads = ["ids", "row crcs", "row modes", "w payload", "w params", "opt state", "replicated", "dense", "dense opt",
                 "rng+extra", "manifest"]
        print(f"{'policy':<18s}{'id':>4s}" + "".join(f"{h:>12s}" for h in heads))
        for label, b in breakdowns.items():
            print(f"{label:<18s}{b['id']:>4d}" + "".join(f"{b[p]:>12,d}" for p in parts))
        print("w params: per-row scale and bias (or codebook) of the quantized rows; opt state: the fused "
              "optimizer's per-row state; row crcs: one CRC-32C per group of about 512 bytes of stored rows "
              "(format 5); row modes: which rows of a residual entry are stored whole, 1 bit a row (format 6)")
        print("\nwhere each policy's restore goes (ms, each phase's slowest rank, median of the reps):")
        for label, b in restore_breakdowns.items():
            print(f"{label:<18s} {breakdown_line(b)}")
        print(f"run time {elapsed:.0f} s (after start-up)")
        if args.json:
            out = {
                "config": {k: v for k, v in vars(args).items() if k not in ("json", "keep", "log_level")}
                | {"world_size": world},
                "peers": peer,
                "policies": {label: {"figures": figs[label], "checkpoints": runs[label],
                                     "dirty_fraction_per_interval": [r["dirty_fraction"] for r in runs[label]],
                                     "latest_checkpoint_bytes_by_part": breakdowns[label],
                                     "restore_breakdown": restore_breakdowns[label]}
                             for label in runs},
                "targets": {label: {k: {"value": figs[label][k], "bound": f"{op} {b}", "met": met[label][k]}
                                    for k, (op, b) in targets.items()} for label, targets in judged.items()},
                "run_time_s": elapsed,
            }
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    finish(args.out_dir, args.keep, rank)


def finish(out_dir: str, keep: bool, rank: int) -> None:
    """Removes ``out_dir`` (unless ``keep``) once every rank is done, and leaves without C++ static
    destructors: gloo's helper threads have aborted finished ranks at exit."""
    dist.barrier()
    if rank == 0 and not keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
