#!/usr/bin/env python3
"""Reliability of the Checkpointer: kills, corrupt files, a full disk, and S3.

    python benchmarks/reliability.py --kills 100 --json out/reliability.json     # make reliability

Every scenario runs 2 gloo ranks of a tiny sharded model (row_wise, table_wise and
column_wise tables under rowwise Adagrad, a dense layer under Adam). Ranks are forked
from a forkserver that already imported torch, torchrec and cnr_torchrec, so a fresh
pair of ranks costs a fraction of a second instead of ~5 s of imports: that is what lets
100 kills, each followed by a restart of fresh processes, fit in a few minutes on 2 cores.

**Kill suite.** Seven groups (consecutive and intermittent policies, fp32 rows and a
quantized codec; consecutive with background compaction, plain and residual, and plain with
``memory_tier: on``), each on its own root; the residual and memory groups keep memory images,
which a restart takes where they are sealed for the newest commit. A phase is one incarnation of a 2-rank job: it
restores whatever is committed, checks the restored state against a reference, saves
once more (that save must commit, and it must clean up the torn directories of the
crash before), then trains with a save after every step or two until one rank is
killed, either at a named fault point (``CNR_FAULT``, see cnr_torchrec/ckpt/fault_injection.py)
or by the harness at a random moment. The harness then reaps the survivor the way
torchrun does (SIGTERM, a grace period, SIGKILL: it may be blocked in a collective or a
store wait) and starts the next phase on the same root. References: at stage time each
rank writes its full local state (shards, optimizer state, dense parameters, Adam
state) for that checkpoint id to a side directory outside the root, and after each
commit reported by ``handle.wait()`` it appends the id to a log. A trial counts as

* ``restores_ok`` when the next phase restored the newest checkpoint that has a manifest
  on disk (scanned by the harness, independently of the code under test) and its state
  equals the reference (exactly for fp32 rows; for a quantized codec every row is the
  codec's image of the reference row, or the reference row itself when it was saved
  before the last restore and is already a decoded row; for residual coding, the reference
  weights are the job's reconstruction once that save commits, and a restore must be within
  1e-6 of them, the float32 rounding of adding the chain up in another order);
* ``torn_restores`` otherwise (another checkpoint, other content, or an error);
* ``lost_commits``: ids that ``handle.wait()`` reported committed but that are newer than
  what the restore found.

**Corruption matrix**, **ENOSPC** and the **S3 round trip**: see :func:`corruption_matrix`,
:func:`enospc_scenario` and :func:`s3_round_trip`. The tests (tests/test_faults.py,
test_corruption.py, test_s3.py) run small versions of the same scenarios and assert on
every field of their results.
"""

from __future__ import annotations

import argparse
import errno
import glob
import hashlib
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# The repository root, for the example models (examples.toy), which are not in the installed package; the
# forkserver and its ranks get this sys.path too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("reliability")

ROWS = {"t0": 240, "t1": 160, "t2": 200}
SHARDING = {"t0": "row_wise", "t1": "table_wise", "t2": "column_wise"}
# Above 4 ranks column-wise shards of 8 columns do not divide: the wide job shards t2 by rows.
WIDE_SHARDING = {"t0": "row_wise", "t1": "table_wise", "t2": "row_wise"}
DIM = 8
GROUPS = (  # (policy, method, bits); "compacting": consecutive with background compaction every 2 deltas;
    # "residual": the same with quantization.residual (its compactions are folds)
    ("consecutive", "none", None),
    ("consecutive", "adaptive", 4),
    ("intermittent", "none", None),
    ("intermittent", "uniform_asym", 4),
    ("compacting", "adaptive", 4),
    ("residual", "adaptive", 4),
    ("memory", "adaptive", 4),
)
# Groups whose ranks keep a memory image (memory_tier): residual coding (auto), and plain coding with
# memory_tier: on ("memory": consecutive with compaction, as "compacting"). A restart on the same host takes
# the image where it is sealed for the agreed checkpoint; the harness checks those restores like any other.
IMAGE_GROUPS = ("residual", "memory")
# Named fault points and the rank they fire on; commit and GC run on rank 0 only.
NAMED_FAULTS = (
    ("write.mid", 0), ("write.mid", 1), ("write.after", 0), ("write.after", 1),
    ("commit.before_manifest", 0), ("commit.after_manifest", 0), ("gc.before", 0), ("gc.mid", 0),
    ("compact.after_write", 0), ("compact.after_write", 1), ("compact.before_manifest", 0),
    ("compact.after_manifest", 0),
    ("image.unsealed", 1), ("image.mid", 0), ("image.updated", 0), ("image.updated", 1),
)
_PRELOAD = ["torch", "torch.distributed", "fbgemm_gpu", "torchrec", "cnr_torchrec", "examples.toy",
            "cnr_torchrec.ckpt", "torchsnapshot", "aiobotocore.session", "boto3"]


# ---------------------------------------------------------------------- the model


def build(world_size: int, seed: int = 0, will_restore: object = False):
    """The tiny model on this process group: (dmp, specs, dense Adam). ``will_restore``: as CheckNRunDMP takes it."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from examples.toy import TableSpec, ToyModel, build_plan, sharders_for

    torch.manual_seed(seed)
    sharding = SHARDING if world_size <= 4 else WIDE_SHARDING
    specs = [TableSpec(t, ROWS[t], DIM, sharding[t], "ebc") for t in ROWS]
    model = ToyModel(specs)
    sharders = sharders_for(EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.05)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=build_plan(model, sharders, world_size), sharders=sharders, will_restore=will_restore)
    dense = [p for n, p in dmp.named_parameters() if n.startswith("dense")]
    return dmp, specs, torch.optim.Adam(dense, lr=0.01)


def train(dmp, specs, opt, steps: int, gen: torch.Generator) -> None:
    from examples.toy import zipf_batch

    for _ in range(steps):
        loss = dmp(zipf_batch(specs, batch_size=8, pooling=3, generator=gen, alpha=1.05))
        loss.backward()
        opt.step()
        opt.zero_grad()


def make_config(root: str, policy: str, method: str, bits: int | None, **kw: Any):
    from cnr_torchrec import load_config

    quant: dict[str, Any] = {"method": method}
    if bits is not None:
        quant["bits"] = bits
    # Two whole chains stay: the corruption matrix falls back from the newest chain to the one before.
    keep = {} if "keep" in kw or "keep_last" in kw else {"keep": {"chains": 2}}
    quant["residual"] = policy == "residual"  # plain coding elsewhere, which the group's reference follows
    if policy == "memory":
        kw = {"memory_tier": {"mode": "on", **kw.pop("memory_tier", {})}, **kw}
    if policy in ("compacting", "residual", "memory"):
        policy, kw = "consecutive", {"compaction": {"max_chain": 2}, **kw}
    kw = {"compaction": None, **kw}  # the plain scenarios keep one chain, as they were measured
    return load_config({"root": root, "policy": policy, "quantization": quant, "save_timeout_s": 60, **keep, **kw})


def local_state(dmp, opt) -> dict[str, torch.Tensor]:
    """Everything of this rank a restore must give back: shards, their optimizer state, dense parameters, Adam."""
    out: dict[str, torch.Tensor] = {}
    tracker = dmp.dirty_tracker
    for t in tracker.tables():
        for i, (k, s) in enumerate(tracker.shards(t)):
            out[f"w/{t}/{i}"] = k.tbe.split_embedding_weights()[s.local_index].detach().clone()
            for j, st in enumerate(k.tbe.split_optimizer_states()[s.local_index]):
                out[f"s/{t}/{i}/{j}"] = st.detach().clone()
    for n, p in dmp.named_parameters():
        if n.startswith("dense"):
            out[f"d/{n}"] = p.detach().clone()
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"adam/{pid}/{k}"] = v.detach().clone()
    return out


def scramble(dmp, opt, seed: int) -> None:
    """Overwrites everything :func:`local_state` covers with noise, so a restore that does nothing is caught."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in dmp.dirty_tracker.tables():
            for k, s in dmp.dirty_tracker.shards(t):
                w = k.tbe.split_embedding_weights()[s.local_index]
                w.copy_(torch.randn(w.shape, generator=gen))
                for st in k.tbe.split_optimizer_states()[s.local_index]:
                    st.copy_(torch.rand(st.shape, generator=gen))
        for n, p in dmp.named_parameters():
            if n.startswith("dense"):
                p.copy_(torch.randn(p.shape, generator=gen))
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.copy_(torch.rand(v.shape, generator=gen))


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], codec: Any,
            allow_decoded: bool = True, atol: float = 0.0, folded: Any = None) -> list[str]:
    """Keys whose restored value is not the reference (``codec``: None for exact rows).

    With a codec, each weight row must be the codec's image of the reference row, or, if
    ``allow_decoded``, the reference row itself: after a restore the live rows are decoded
    rows, and a row not touched since is restored as the decoded row it already is. With
    ``atol`` (a residual chain, whose reference holds what the chain restores), weights must be
    within it of the reference. With ``folded`` (the codec of a residual chain's fold, which the
    restore took), weights must be that codec's image of the reference, each element within ``atol``
    or, where the sum fell on the other side of a rounding edge, one step.
    """
    bad = []
    for key, r in ref.items():
        g = got.get(key)
        if g is None or g.shape != r.shape:
            bad.append(f"{key}: missing or shape {None if g is None else list(g.shape)} != {list(r.shape)}")
            continue
        if key.startswith("w/") and folded is not None:
            encoded = folded.encode(r.float().contiguous())
            off = (g - folded.decode(encoded)).abs()
            step = encoded.scale.float().unsqueeze(1) * 1.001 + atol
            if not bool((off <= step).all()):
                bad.append(f"{key}: {int((off > step).sum())} elements more than a step off the fold's image")
        elif key.startswith("w/") and atol:
            if not torch.allclose(g, r, rtol=0.0, atol=atol):
                bad.append(f"{key}: max diff {(g.double() - r.double()).abs().max().item():.3g} > {atol:g}")
        elif key.startswith("w/") and codec is not None:
            q = codec.decode(codec.encode(r.float()))
            rows_ok = (g == q).all(1) | ((g == r).all(1) if allow_decoded else False)
            if not bool(rows_ok.all()):
                bad.append(f"{key}: {int((~rows_ok).sum())} rows are neither the codec's image nor the reference")
        elif not torch.equal(g, r):
            bad.append(f"{key}: max diff {(g.double() - r.double()).abs().max().item():.3g}")
    return bad


def codec_of(method: str, bits: int | None):
    from cnr_torchrec.quant import get_codec

    return None if method == "none" else get_codec(method, bits)


# ---------------------------------------------------------------------- references and logs


def ref_path(side: str, ckpt_id: int, rank: int) -> str:
    return os.path.join(side, "refs", f"ref-{ckpt_id:08d}-r{rank}.pt")


def install_ref_hook(side: str, rank: int, dmp, opt) -> None:
    """Makes every save write this rank's full state for its checkpoint id, at stage time, before the write starts.

    Stage runs on the training thread before the background write is submitted, so the
    reference of an id is on disk before any byte of that checkpoint is.
    """
    from cnr_torchrec.ckpt import checkpointer as ckpt_mod

    real = ckpt_mod.stage
    os.makedirs(os.path.join(side, "refs"), exist_ok=True)

    def staging(decision, *args, **kw):
        out = real(decision, *args, **kw)
        path = ref_path(side, decision.ckpt_id, rank)
        torch.save(local_state(dmp, opt), path + ".tmp")
        os.replace(path + ".tmp", path)
        return out

    ckpt_mod.stage = staging


def install_residual_ref_hook(side: str, rank: int, dmp) -> None:
    """Residual coding: a checkpoint restores what the job's reconstruction will hold once it commits, not the
    live rows. So once a save's rows are written (before the rank reports, so before any manifest), its
    reference's weights become that reconstruction."""
    from cnr_torchrec.ckpt.save import commit as commit_mod

    real = commit_mod.write_rank

    def writing(staged, codec, storage, **kw):
        report = real(staged, codec, storage, **kw)
        rec = kw.get("reconstruction")
        path = ref_path(side, staged.decision.ckpt_id, rank)
        ref = torch.load(path, weights_only=True)
        tracker = dmp.dirty_tracker
        for t in tracker.tables():
            for i, (_, s) in enumerate(tracker.shards(t)):
                rows = rec.after_commit((t, tuple(s.rows), tuple(s.cols)))
                if rows is not None:
                    ref[f"w/{t}/{i}"] = rows
        torch.save(ref, path + ".tmp")
        os.replace(path + ".tmp", path)
        return report

    commit_mod.write_rank = writing


def load_ref(side: str, ckpt_id: int, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(ref_path(side, ckpt_id, rank), weights_only=True)


def spy_restored() -> dict[str, int]:
    """Records the id of the checkpoint each restore attempt applies (the last one is what was restored)."""
    from cnr_torchrec.ckpt.restore import restorer as restorer_mod  # where a restore applies the chain

    seen: dict[str, Any] = {"ids": [], "ok": []}
    real = restorer_mod.restore_chain

    def spy(manifests, *args, **kw):
        seen["ids"].append(manifests[-1].id)
        seen["ok"].append(False)
        staged = real(manifests, *args, **kw)  # the staged shards, which the restorer commits once every rank agrees
        seen["ok"][-1] = True
        return staged

    restorer_mod.restore_chain = spy
    return seen


def append_line(path: str, line: str) -> None:
    """One line, straight to the kernel: it survives a SIGKILL right after."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def read_commit_logs(side: str) -> set[int]:
    ids: set[int] = set()
    for p in glob.glob(os.path.join(side, "commits-r*.log")):
        with open(p) as f:
            ids |= {int(x) for x in f.read().split() if x.isdigit()}
    return ids


_DIR_RE = re.compile(r"^ckpt-(\d{8})$")


def s3_client_kwargs(opts: dict[str, Any]) -> dict[str, Any]:
    keys = ("endpoint_url", "aws_access_key_id", "aws_secret_access_key", "region_name")
    return {k: opts[k] for k in keys if k in opts}


def scan(root: str, opts: dict[str, Any] | None = None) -> dict[int, bool]:
    """Checkpoint directories under ``root`` -> whether a manifest.json exists; read without cnr_torchrec."""
    out: dict[int, bool] = {}
    if root.startswith("s3://"):
        import boto3

        bucket, _, prefix = root[5:].partition("/")
        base = prefix.strip("/") + "/" if prefix.strip("/") else ""
        client = boto3.client("s3", **s3_client_kwargs(opts or {}))
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
            for o in page.get("Contents", []):
                d, _, name = o["Key"][len(base):].partition("/")
                if (m := _DIR_RE.match(d)) and name:
                    i = int(m.group(1))
                    out[i] = out.get(i, False) or name == "manifest.json"
        return out
    path = root.removeprefix("fs://")
    if not os.path.isdir(path):
        return out
    for d in os.listdir(path):
        if (m := _DIR_RE.match(d)) and os.path.isdir(os.path.join(path, d)):
            out[int(m.group(1))] = os.path.isfile(os.path.join(path, d, "manifest.json"))
    return out


def read_body(root: str, opts: dict[str, Any] | None, ckpt_id: int) -> dict[str, Any]:
    """The body of checkpoint ``ckpt_id``'s manifest, read as plain JSON without cnr_torchrec."""
    rel = f"ckpt-{ckpt_id:08d}/manifest.json"
    if root.startswith("s3://"):
        import boto3

        bucket, _, prefix = root[5:].partition("/")
        key = f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel
        raw = boto3.client("s3", **s3_client_kwargs(opts or {})).get_object(Bucket=bucket, Key=key)["Body"].read()
    else:
        with open(os.path.join(root.removeprefix("fs://"), rel), "rb") as f:
            raw = f.read()
    return json.loads(raw)["body"]


def newest_state(root: str, opts: dict[str, Any] | None, committed: list[int]) -> int | None:
    """The committed checkpoint a restore must take: the newest step, and of those the highest id (a
    compacted baseline has its tip's step and a higher id than the deltas after that tip)."""
    if not committed:
        return None
    return max(committed, key=lambda i: (read_body(root, opts, i)["step"], i))


# ---------------------------------------------------------------------- forked ranks


_CTX: Any = None


def context():
    """A forkserver context whose server has torch, torchrec and this module imported."""
    global _CTX
    if _CTX is None:
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD + ["reliability"])
        _CTX = ctx
    return _CTX


def _rank_main(fn: Callable, rank: int, world_size: int, rdzv: str, args: tuple, out_dir: str,
               env: dict[str, str], init: str | None = None) -> None:
    fd = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True,
                        format=f"[rank{rank} %(relativeCreated)d] %(levelname)s %(name)s: %(message)s")
    for noisy in ("torch", "torchrec", "fbgemm_gpu", "botocore", "aiobotocore"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    from cnr_torchrec.ckpt import fault_injection as faults

    faults.configure("")  # nothing armed unless the scenario arms it
    try:
        dist.init_process_group("gloo", init_method=init or f"file://{rdzv}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        write_json(os.path.join(out_dir, f"result{rank}.json"), result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        sys.stderr.write(f"[rank {rank}] failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_ranks(fn: Callable, world_size: int, args: tuple, out_dir: str, env: dict[str, str] | None = None,
                init: str | None = None):
    """Forks ``world_size`` ranks running ``fn``; their gloo group meets through a file store under ``out_dir``
    (which outlives every rank, as torchrun's agent store does), or ``init`` (``tcp://...``: a store that
    rank 0's process hosts, as ``env://`` launches by srun or mpirun host it)."""
    os.makedirs(out_dir, exist_ok=True)
    rdzv = os.path.join(out_dir, "rdzv")
    ctx = context()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, rdzv, args, out_dir, dict(env or {}), init))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs


def log_tail(out_dir: str, n: int = 40) -> str:
    parts = []
    for p in sorted(glob.glob(os.path.join(out_dir, "rank*.log"))):
        with open(p, errors="replace") as f:
            lines = f.read().splitlines()
        parts.append(f"--- {os.path.basename(p)}\n" + "\n".join(lines[-n:]))
    return "\n".join(parts)


def run_ranks(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 120.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on forked gloo ranks; returns each rank's (JSON) return value.

    Raises:
        RuntimeError: a rank failed or the ranks did not finish within ``timeout`` (with their log tails).
    """
    with tempfile.TemporaryDirectory(prefix="cnr-ranks-") as out:
        procs = start_ranks(fn, world_size, args, out, env)
        deadline = time.monotonic() + timeout
        pending = list(procs)
        while pending and time.monotonic() < deadline:
            mp.connection.wait([p.sentinel for p in pending], timeout=0.5)
            pending = [p for p in pending if p.exitcode is None]
            if any(p.exitcode not in (None, 0) for p in procs):
                break
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        reap(procs)
        if failed:
            what = "timed out" if any(c is None for _, c in failed) else "failed"
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} {what} on ranks {failed}:\n{log_tail(out)}")
        results = []
        for r in range(world_size):
            with open(os.path.join(out, f"result{r}.json")) as f:
                results.append(json.load(f))
        return results


def reap(procs, grace: float = 2.0, notice: float = 0.0) -> list[int | None]:
    """What torchrun's agent does to the rest of a failed group: SIGTERM, a grace period, then SIGKILL.

    ``notice``: how long the failure goes unnoticed first (torchrun polls its workers every 0.1 s by default).
    """
    time.sleep(notice)
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        try:
            p.terminate()
        except (ProcessLookupError, OSError):
            pass
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(5)
    return [p.exitcode for p in procs]


# ---------------------------------------------------------------------- kill suite


def _phase_worker(rank: int, world_size: int, p: dict[str, Any]) -> dict[str, Any]:
    """One incarnation of the job: restore and check, one save that must commit, then train until killed."""
    from cnr_torchrec import Checkpointer, CheckpointNotFoundError, SaveFailedError
    from cnr_torchrec.ckpt import fault_injection as faults

    side, pdir = p["side"], p["phase_dir"]
    config = make_config(p["root"], p["policy"], p["method"], p["bits"], storage_options=p["opts"],
                         memory_tier={"path": p["shm"]})
    # A restarted incarnation builds as a restarted job does: its tables' initial values wait for the restore
    # (which, from a memory image, then copies the image in as it checks it).
    dmp, specs, opt = build(world_size, seed=p["seed"], will_restore=config)
    seen = spy_restored()
    install_ref_hook(side, rank, dmp, opt)
    residual = p["policy"] == "residual"
    if residual:
        install_residual_ref_hook(side, rank, dmp)
    ckpt = Checkpointer(dmp, config, dense_optimizer=opt)
    gen = torch.Generator().manual_seed(p["seed"] * 7 + rank)
    commits = os.path.join(side, f"commits-r{rank}.log")

    def settle(handle) -> int | None:
        try:
            info = handle.wait()
        except SaveFailedError:
            append_line(commits, f"failed-{handle.decision.ckpt_id}")
            return None
        append_line(commits, str(info.id))
        return info.id

    out: dict[str, Any] = {"restored": None, "error": None, "mismatch": [], "restart_commit": None,
                           "leftover": None, "attempts": [], "sources": []}
    step = 0
    try:
        step = ckpt.restore()
        out["restored"] = seen["ids"][-1]
        out["attempts"] = seen["ids"]
        out["sources"] = ckpt.last_restore_sources
        body = read_body(p["root"], p["opts"], out["restored"])
        same_as = body.get("equals")  # a compacted baseline: its tip's reference
        folded = codec_of(body["codec"]["method"], body["codec"]["bits"]) if residual and same_as is not None else None
        # A residual chain restores its reconstruction to the bit (every reader adds oldest copy first): exact.
        out["mismatch"] = compare(local_state(dmp, opt), load_ref(side, same_as or out["restored"], rank),
                                  None if residual else codec_of(p["method"], p["bits"]), folded=folded)[:5]
    except CheckpointNotFoundError as e:
        out["error"] = ["CheckpointNotFoundError", str(e)]
    except Exception as e:  # noqa: BLE001 - the harness counts it as a failed restore
        out["error"] = [type(e).__name__, str(e)]
    # The first save after a restart must commit and clean up what the crash left behind.
    train(dmp, specs, opt, 1, gen)
    step += 1
    out["restart_commit"] = settle(ckpt.save(step))
    if rank == 0 and out["restart_commit"] is not None:
        out["leftover"] = sorted(i for i, has in scan(p["root"], p["opts"]).items()
                                 if not has and i < out["restart_commit"])
    write_json(os.path.join(pdir, f"phase-result{rank}.json"), out)
    dist.barrier()  # both results are on disk before anything may kill either rank

    faults.configure(p["fault"] or "")
    open(os.path.join(pdir, f"train{rank}"), "w").close()
    prev = None
    for _ in range(p["saves"]):
        train(dmp, specs, opt, p["steps_per_save"], gen)  # overlaps with the previous save's background write
        step += p["steps_per_save"]
        if prev is not None:
            settle(prev)  # the training loop learns of the commit here, before the next save's collective
        prev = ckpt.save(step)
        if p["sync"]:  # or at once (a job that waits for each commit)
            settle(prev)
            prev = None
    if prev is not None:
        settle(prev)
    try:  # a background compaction's fault points come before "done" (the harness's cue), however busy the machine
        ckpt.wait(compaction=True)
    except SaveFailedError:
        pass  # settle() recorded it
    open(os.path.join(pdir, f"done{rank}"), "w").close()
    if p["hold"]:
        time.sleep(300)  # the harness kills the job before this ends
        os._exit(3)
    ckpt.close()
    return out


@dataclass
class Trial:
    group: int
    kind: str  # a fault point, or "random"
    rank: int
    nth: int = 0
    sync: bool = False  # the training loop waits for each commit right after its save
    fired: bool = False  # the named fault killed the rank (False: killed by the harness instead)
    late: bool = False  # the harness kill came after training had finished
    victim_exit: int | None = None
    survivor_exit: int | None = None
    expected: int | None = None  # newest checkpoint with a manifest after the crash
    torn_dirs: list[int] = field(default_factory=list)  # directories without a manifest after the crash
    reported: list[int] = field(default_factory=list)
    restored: int | None = None
    ok: bool = False
    lost: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # where each rank of the restart took its shards
    restart_ok: bool = False
    detail: str = ""


@dataclass
class _Group:
    index: int
    root: str
    side: str
    shm: str  # the group's memory_tier.path: both ranks on this host
    policy: str
    method: str
    bits: int | None
    phase: int = 0
    pending: Trial | None = None


class KillSuite:
    """Runs kill trials on 2 forked ranks and counts what the restores found.

    Args:
        base_root: where the groups' checkpoint roots go (a directory, or ``s3://bucket/prefix``).
        side: a local directory for references, logs and rendezvous files.
        opts: storage_options (S3 endpoint and credentials).
        groups: (policy, method, bits) per group.
        saves: saves per phase after the restart save; steps_per_save: training steps between them.
    """

    def __init__(self, base_root: str, side: str, *, opts: dict[str, Any] | None = None,
                 groups: tuple = GROUPS, saves: int = 6, steps_per_save: int = 1, seed: int = 0,
                 env: dict[str, str] | None = None) -> None:
        self.opts = dict(opts or {})
        self.env = dict(env or {})
        self.saves, self.steps_per_save = saves, steps_per_save
        self.rng = random.Random(seed)
        self.groups = []
        for i, (policy, method, bits) in enumerate(groups):
            root = f"{base_root.rstrip('/')}/g{i}-{policy}-{method}"
            gside = os.path.join(side, f"g{i}")
            os.makedirs(gside, exist_ok=True)
            shm = os.path.join(gside, "shm")  # a directory of its own: the group's host, apart from the others
            os.makedirs(shm, exist_ok=True)
            self.groups.append(_Group(i, root, gside, shm, policy, method, bits))
        self.trials: list[Trial] = []
        self.errors: list[str] = []
        self.train_s = 0.4  # estimate of a phase's training part; random kills land within it
        self.phase_s: list[float] = []

    # -------------------------------------------------------------- one phase

    def _phase(self, g: _Group, fault: str | None, trial: Trial | None) -> list[dict[str, Any]] | None:
        """Runs one phase of group ``g``; kills a rank as ``trial`` says. Returns the ranks' restore results."""
        pdir = os.path.join(g.side, f"phase-{g.phase:04d}")
        os.makedirs(pdir)
        spec = {"root": g.root, "side": g.side, "shm": g.shm, "phase_dir": pdir, "policy": g.policy, "method": g.method,
                "bits": g.bits, "opts": self.opts, "seed": 1000 * g.index + g.phase + 1, "fault": fault,
                # An intermittent chain takes a new baseline (and so collects garbage) every ~7 saves here.
                "saves": (max(self.saves, 10) if trial.kind == "gc.mid" else self.saves) if trial else 0,
                "sync": bool(trial and trial.sync), "steps_per_save": self.steps_per_save, "hold": trial is not None}
        g.phase += 1
        t0 = time.monotonic()
        procs = start_ranks(_phase_worker, 2, (spec,), pdir, self.env)
        marker = lambda name: all(os.path.exists(os.path.join(pdir, f"{name}{r}")) for r in range(2))  # noqa: E731
        deadline = t0 + 120
        problem = ""

        def wait(seconds: float) -> bool:
            """Sleeps up to ``seconds``; True if a rank exited meanwhile."""
            alive = [p.sentinel for p in procs if p.exitcode is None]
            if len(alive) < len(procs):
                return True
            return bool(mp.connection.wait(alive, timeout=seconds))

        if trial is None:  # the last phase of a group: restore, check, save, exit
            while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
                wait(0.2)
            if any(p.exitcode != 0 for p in procs):
                problem = f"final phase ended with {[p.exitcode for p in procs]}"
        elif trial.kind != "random":
            while time.monotonic() < deadline:
                if wait(0.02):
                    break
                if marker("done"):  # the fault never came: kill at the end instead
                    if not wait(0.3):
                        break
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None]
            if dead:
                victim = dead[0] if len(dead) == 1 else trial.rank
                trial.victim_exit = procs[victim].exitcode
                trial.fired = victim == trial.rank and procs[victim].exitcode == -signal.SIGKILL
                if not trial.fired:
                    problem = f"rank {victim} exited with {procs[victim].exitcode} before any kill"
            elif time.monotonic() >= deadline:
                problem = "the phase hung"
            else:
                trial.late = True
                procs[trial.rank].kill()
                procs[trial.rank].join(5)
                trial.victim_exit = procs[trial.rank].exitcode
        else:
            while not marker("train") and time.monotonic() < deadline:
                if wait(0.02):
                    break
            if any(p.exitcode is not None for p in procs):
                problem = f"a rank exited before the kill: {[p.exitcode for p in procs]}"
            elif not marker("train"):
                problem = "the phase hung before training"
            else:
                delay = self.rng.uniform(0.0, self.train_s)
                if wait(delay):
                    problem = f"a rank exited before the kill: {[p.exitcode for p in procs]}"
                else:
                    trial.late = marker("done")
                    procs[trial.rank].kill()
                    procs[trial.rank].join(5)
                    trial.victim_exit = procs[trial.rank].exitcode
        if trial is not None:
            t_train = os.path.join(pdir, "train0")
            if marker("done") and os.path.exists(t_train):  # learn how long training takes
                took = os.path.getmtime(os.path.join(pdir, "done0")) - os.path.getmtime(t_train)
                self.train_s = 0.7 * self.train_s + 0.3 * max(0.1, took)
        exits = reap(procs, notice=0.1)
        if trial is not None:
            trial.survivor_exit = exits[1 - trial.rank]
        self.phase_s.append(time.monotonic() - t0)
        if problem:
            self.errors.append(f"group {g.index} phase {g.phase - 1}: {problem}\n{log_tail(pdir)}")
        results = []
        for r in range(2):
            path = os.path.join(pdir, f"phase-result{r}.json")
            if not os.path.exists(path):
                if not problem:
                    self.errors.append(f"group {g.index} phase {g.phase - 1}: no result from rank {r}\n"
                                       f"{log_tail(pdir)}")
                return None
            with open(path) as f:
                results.append(json.load(f))
        return results

    # -------------------------------------------------------------- judging

    def _judge(self, trial: Trial, results: list[dict[str, Any]] | None) -> None:
        """Judges the trial of the previous phase from this phase's restore."""
        if results is None:
            trial.detail = "the restart did not report"
            return
        restored = {r["restored"] for r in results}
        errors = [r["error"] for r in results if r["error"]]
        mismatch = [m for r in results for m in r["mismatch"]]
        if trial.expected is None:
            trial.ok = len(errors) == 2 and all(e[0] == "CheckpointNotFoundError" for e in errors)
            trial.detail = "" if trial.ok else f"nothing was committed, yet restore gave {restored} / {errors}"
        else:
            trial.restored = results[0]["restored"]
            trial.sources = [src for _, src, _ in results[0].get("sources", [])]
            trial.ok = restored == {trial.expected} and not errors and not mismatch
            if not trial.ok:
                trial.detail = f"expected {trial.expected}, restored {restored}, errors {errors}, diffs {mismatch[:3]}"
        newest = trial.restored if trial.restored is not None else -1
        trial.lost = sorted(i for i in trial.reported if i > newest)
        commits = {r["restart_commit"] for r in results}
        trial.restart_ok = len(commits) == 1 and None not in commits and results[0]["leftover"] == []
        if not trial.restart_ok:
            trial.detail += f" restart save: commits {commits}, leftover {results[0]['leftover']}"

    # -------------------------------------------------------------- driver

    def _pick(self, g: _Group, i: int) -> tuple[Trial, str | None]:
        def fits(point: str) -> bool:  # compaction's points need compaction; gc.mid, a chain that is collected
            if point.startswith("compact."):
                return g.policy in ("compacting", "residual", "memory")
            if point.startswith("image."):
                return g.policy in IMAGE_GROUPS
            return point != "gc.mid" or g.policy in ("intermittent", "compacting")

        named = [f for f in NAMED_FAULTS if fits(f[0])]
        menu = named + [("random", r) for r in (0, 1)] * 3
        # Each group walks the whole menu once (from its own starting point), then draws at random.
        kind, rank = menu[(i + 3 * g.index) % len(menu)] if i < len(menu) else self.rng.choice(menu)
        sync = self.rng.random() < 0.5
        if kind == "random":
            rank = self.rng.choice((0, 1))
            return Trial(g.index, kind, rank, sync=sync), None
        nth = self.rng.randint(1, 2) if kind == "gc.mid" else self.rng.randint(1, max(1, self.saves - 1))
        return Trial(g.index, kind, rank, nth, sync), f"{kind}:rank={rank}:nth={nth}"

    def run(self, kills: int, schedule: list[tuple] | None = None, progress: bool = False) -> dict[str, Any]:
        """Runs ``kills`` trials round-robin over the groups, then one last restore per group.

        Args:
            schedule: explicit trials (group, kind, rank, nth[, sync]) instead of the built-in rotation.
        """
        counters = [0] * len(self.groups)
        plan = []
        for i in range(kills):
            if schedule is not None:
                gi, kind, rank, nth, *sync = schedule[i]
                g = self.groups[gi]
                trial = Trial(gi, kind, rank, nth, bool(sync and sync[0]))
                fault = None if kind == "random" else f"{kind}:rank={rank}:nth={nth}"
            else:
                g = self.groups[i % len(self.groups)]
                trial, fault = self._pick(g, counters[g.index])
            counters[g.index] += 1
            plan.append((g, trial, fault))
        t0 = time.monotonic()
        for n, (g, trial, fault) in enumerate(plan):
            results = self._phase(g, fault, trial)
            if g.pending is not None:
                self._judge(g.pending, results)
            found = scan(g.root, self.opts)
            committed = [i for i, has in found.items() if has]
            trial.expected = newest_state(g.root, self.opts, committed)
            trial.torn_dirs = sorted(i for i, has in found.items() if not has)
            trial.reported = sorted(read_commit_logs(g.side))
            g.pending = trial
            self.trials.append(trial)
            if progress:
                print(f"  kill {n + 1:3d}/{kills}: group {g.index} {trial.kind:<22} rank {trial.rank} "
                      f"{'fired' if trial.fired else 'late' if trial.late else 'timer'}; committed "
                      f"{trial.expected}, torn dirs {trial.torn_dirs}  ({time.monotonic() - t0:.0f}s)", flush=True)
        for g in self.groups:
            if g.pending is not None:
                self._judge(g.pending, self._phase(g, None, None))
                g.pending = None
        return self.summary()

    def summary(self) -> dict[str, Any]:
        judged = [t for t in self.trials]
        lost = {(t.group, i) for t in judged for i in t.lost}
        return {
            "kills": len(judged),
            "restores_ok": sum(t.ok for t in judged),
            "torn_restores": sum(not t.ok for t in judged),
            "lost_commits": len(lost),
            "restart_saves_ok": sum(t.restart_ok for t in judged),
            "named_fired": sum(t.fired for t in judged),
            "named_unfired": sum(t.kind != "random" and not t.fired for t in judged),
            "random_kills": sum(t.kind == "random" for t in judged),
            "late_kills": sum(t.late for t in judged),
            "sync_trials": sum(t.sync for t in judged),
            "kills_after_a_reported_commit_of_the_newest": sum(t.expected is not None and t.expected in t.reported
                                                               for t in judged),
            "kills_with_torn_dirs": sum(bool(t.torn_dirs) for t in judged),
            "kills_with_nothing_committed": sum(t.expected is None for t in judged),
            "restores_with_a_rank_from_memory": sum("memory" in t.sources for t in judged),
            "mixed_restores": sum(set(t.sources) == {"memory", "storage"} for t in judged),
            "wrong_restores_from_memory": sum("memory" in t.sources and not t.ok for t in judged),
            "kills_by_point": _count(t.kind for t in judged),
            "harness_errors": len(self.errors),
            "median_phase_s": sorted(self.phase_s)[len(self.phase_s) // 2] if self.phase_s else None,
            "failures": [f"group {t.group} {t.kind} rank {t.rank} nth {t.nth}: {t.detail}" for t in judged
                         if not (t.ok and t.restart_ok)][:20],
        }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


# ---------------------------------------------------------------------- ENOSPC


def enospc_scenario(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A full disk while writing a rank file (rank 1), then while committing the manifest (rank 0).

    Each time: both ranks' ``handle.wait()`` raise SaveFailedError naming ENOSPC, training
    goes on, the failed checkpoint's directory is gone, the previous checkpoint is still
    listed, and the next save commits as a new baseline. Finally fresh models restore the
    newest checkpoint and the one before the first failure, exactly.
    """
    from cnr_torchrec import Checkpointer, SaveFailedError
    from cnr_torchrec.ckpt.format.bytes import storage as storage_mod

    checks: dict[str, bool] = {}
    dmp, specs, opt = build(world_size)
    config = make_config(root, "consecutive", "none", None, keep={"chains": 3})  # the first chain must survive
    ckpt = Checkpointer(dmp, config, dense_optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    train(dmp, specs, opt, 2, gen)
    ckpt.save(1).wait()
    train(dmp, specs, opt, 2, gen)
    good = ckpt.save(2).wait()
    good_state = local_state(dmp, opt)

    real_write = storage_mod.Storage.write

    def full_disk(self, path, data):
        # Half the payload's chunk lands, then the device is full: what a real ENOSPC leaves behind.
        whole = b"".join(bytes(p) for p in data) if isinstance(data, (list, tuple)) else bytes(data)
        full = os.path.join(self.local_dir, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(whole[: len(whole) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", full)

    real_atomic = storage_mod.Storage.write_atomic

    def full_disk_manifest(self, path, data):
        if path.endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_atomic(self, path, data)

    step = 2
    last = good
    for where, patch in (("rank file", "fs"), ("manifest", "atomic")):
        if patch == "fs" and rank == 1:
            storage_mod.Storage.write = full_disk
        if patch == "atomic" and rank == 0:
            storage_mod.Storage.write_atomic = full_disk_manifest
        train(dmp, specs, opt, 2, gen)
        step += 1
        handle = ckpt.save(step)
        try:
            handle.wait()
            checks[f"{where}: save failed"] = False
        except SaveFailedError as e:
            checks[f"{where}: save failed"] = "No space left" in str(e)
        storage_mod.Storage.write = real_write
        storage_mod.Storage.write_atomic = real_atomic
        failed_id = handle.decision.ckpt_id
        train(dmp, specs, opt, 2, gen)  # training goes on: collectives still work on both ranks
        dist.barrier()
        checks[f"{where}: partial files removed"] = failed_id not in scan(root)
        checks[f"{where}: previous checkpoint still listed"] = [i.id for i in ckpt.list()][-1] == last.id
        step += 1
        after = ckpt.save(step).wait()
        checks[f"{where}: next save is a committed baseline"] = after.kind == "baseline" and after.id > failed_id
        last = after
    newest_state = local_state(dmp, opt)
    ckpt.close()

    for label, want_step, want in (("newest", None, newest_state), ("before the failures", 2, good_state)):
        fresh, _, opt2 = build(world_size, seed=99)
        restorer = Checkpointer(fresh, config, dense_optimizer=opt2)
        got_step = restorer.restore(step=want_step)
        restorer.close()
        diffs = compare(local_state(fresh, opt2), want, None)
        checks[f"restore of the {label} checkpoint is exact"] = not diffs and (want_step is None or got_step == 2)
    return checks


# ---------------------------------------------------------------------- corruption


def _tree_digest(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def corruption_cases(root: str, positions: int = 4) -> list[dict[str, Any]]:
    """Byte flips at ``positions`` places and two truncations of every file of checkpoints 4 and 2, and index.json.

    The root holds chains [0, 1] and [2, 3, 4]. ``fallback`` is the checkpoint that
    ``on_corrupt: fallback`` must restore: 3 for a file of 4, 1 for a file of 2 (every
    checkpoint of that chain needs it); index.json is not read on a filesystem root.
    """
    cases = []
    files = [(f"ckpt-{i:08d}/{name}", fb) for i, fb in ((4, 3), (2, 1))
             for name in ("manifest.json", "rank-00000.bin", "rank-00001.bin")] + [("index.json", 4)]
    for rel, fallback in files:
        n = os.path.getsize(os.path.join(root, rel))
        spots = sorted({min(n - 1, (k * n) // positions + 3) for k in range(positions)} | {n - 1})
        for pos in spots:
            cases.append({"file": rel, "how": f"flip@{pos}", "pos": pos, "fallback": fallback})
        for keep in (n // 2, n - 1):
            cases.append({"file": rel, "how": f"truncate@{keep}", "keep": keep, "fallback": fallback})
    return cases


def _inject(root: str, case: dict[str, Any]) -> None:
    path = os.path.join(root, case["file"])
    if "pos" in case:
        with open(path, "r+b") as f:
            f.seek(case["pos"])
            b = f.read(1)
            f.seek(case["pos"])
            f.write(bytes([b[0] ^ 0x01]))
    else:
        os.truncate(path, case["keep"])


def corruption_matrix(rank: int, world_size: int, work: str, positions: int = 4) -> dict[str, Any]:
    """Every case of :func:`corruption_cases`, restored under ``fail`` and ``fallback``, and checked by verify_root.

    A case is detected when: under ``fail``, every rank raises CorruptCheckpointError whose
    ``.path`` is the damaged file; under ``fallback``, both ranks restore the expected older
    checkpoint with exactly its content and the warning names the file; and verify_root
    reports a problem for that file. index.json is only read by stores that cannot list,
    so on a filesystem root its damage is harmless to restore (which must then restore the
    newest checkpoint exactly under both settings) and is detected by verify_root alone.
    A restore reads only the rows it applies (format 5), so a flipped payload byte of a row
    that a newer checkpoint supersedes is never read: such a case is *read around* when
    both settings restore the newest checkpoint exactly and verify_root names the file.
    Restore never changes a byte under the root.
    """
    from cnr_torchrec import Checkpointer, CorruptCheckpointError

    try:
        from cnr_torchrec.ckpt.tools.verify import verify_root
    except ImportError:
        verify_root = None

    base = os.path.join(work, "base")
    dmp, specs, opt = build(world_size)
    gen = torch.Generator().manual_seed(rank)
    refs: dict[int, dict[str, torch.Tensor]] = {}
    for n_saves in (2, 3):  # two Checkpointers: chains [0, 1] and [2, 3, 4]
        ckpt = Checkpointer(dmp, make_config(base, "consecutive", "none", None), dense_optimizer=opt)
        for _ in range(n_saves):
            train(dmp, specs, opt, 2, gen)
            info = ckpt.save(len(refs) + 1).wait()
            refs[info.id] = local_state(dmp, opt)
        ckpt.close()
    assert sorted(refs) == [0, 1, 2, 3, 4], sorted(refs)

    seen = spy_restored()
    capture = _Capture()
    logging.getLogger("cnr_torchrec.ckpt").addHandler(capture)
    cases = corruption_cases(base, positions)
    results = []
    for n, case in enumerate(cases):
        root = os.path.join(work, f"case-{n:03d}")
        if rank == 0:
            shutil.copytree(base, root)
            _inject(root, case)
            before = _tree_digest(root)
        dist.barrier()
        res: dict[str, Any] = {**case, "detected": {}}
        for mode in ("fail", "fallback"):
            scramble(dmp, opt, seed=n * 2 + (mode == "fail"))
            capture.lines.clear()
            seen["ids"].clear()
            seen["ok"].clear()
            ckpt = Checkpointer(dmp, make_config(root, "consecutive", "none", None, on_corrupt=mode),
                                dense_optimizer=opt)
            err = None
            try:
                ckpt.restore()
            except CorruptCheckpointError as e:
                err = e
            except Exception as e:  # noqa: BLE001 - any other error is a miss, reported as such
                err = e
            ckpt.close()
            index = case["file"] == "index.json"
            exact = err is None and seen["ids"][-1] == 4 and not compare(local_state(dmp, opt), refs[4], None)
            read_around = not index and case["file"].endswith(".bin") and exact
            res.setdefault("read_around", {})[mode] = read_around
            if index:
                ok = exact
            elif read_around:
                ok = True
            elif mode == "fail":
                ok = isinstance(err, CorruptCheckpointError) and err.path == case["file"]
            else:
                ok = (err is None and seen["ids"][-1] == case["fallback"]
                      and not compare(local_state(dmp, opt), refs[case["fallback"]], None)
                      and any(case["file"] in line for line in capture.lines))
            res["detected"][mode] = ok
            if not ok:
                res.setdefault("why", {})[mode] = (f"{type(err).__name__}: {err}" if err else
                                                   f"restored {seen['ids']}, log {capture.lines[:2]}")
            # A partial apply on one rank before the fallback (the other rank's file was bad).
            res.setdefault("partial_apply", {})[mode] = len(seen["ok"]) > 1 and seen["ok"][0]
        if rank == 0:
            res["unchanged"] = _tree_digest(root) == before
            if verify_root is not None:
                problems = verify_root(root)
                res["verify"] = any(p.path == case["file"] for p in problems)
                if not res["verify"]:
                    res["verify_said"] = [str(p) for p in problems[:3]]
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root)
        results.append(res)
    logging.getLogger("cnr_torchrec.ckpt").removeHandler(capture)
    return {"cases": results, "verify_available": verify_root is not None}


def summarize_corruption(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Merges the ranks' views of :func:`corruption_matrix` into counts (rank 0 holds verify and unchanged)."""
    r0, rest = per_rank[0], per_rank[1:]
    injected = detected = read_around = 0
    misses = []
    for k, case in enumerate(r0["cases"]):
        injected += 1
        modes = all(all(p["cases"][k]["detected"].values()) for p in per_rank)
        verified = case.get("verify", True) if r0["verify_available"] else True
        ok = modes and verified and case["unchanged"]
        around = ok and all(all(p["cases"][k]["read_around"].values()) for p in per_rank)
        read_around += around
        detected += ok and not around
        if not ok:
            misses.append({"file": case["file"], "how": case["how"], "detected": [p["cases"][k]["detected"]
                           for p in per_rank], "verify": case.get("verify"), "unchanged": case["unchanged"],
                           "why": [p["cases"][k].get("why") for p in per_rank], "verify_said": case.get("verify_said")})
    partial = sum(any(p["cases"][k]["partial_apply"]["fallback"] for p in [r0, *rest])
                  for k in range(len(r0["cases"])))
    return {"corruptions_injected": injected, "corruptions_detected": detected, "corruptions_read_around": read_around,
            "misses": misses,
            "fallbacks_after_partial_apply": partial, "verify_available": r0["verify_available"]}


# ---------------------------------------------------------------------- S3


_MOTO = r"""
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


class Moto:
    """A moto S3 server in a subprocess (no server thread in the harness, which forks ranks)."""

    def __init__(self, bucket: str = "cnr-test") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError("the moto server did not start")
        self.endpoint = f"http://127.0.0.1:{int(line)}"
        self.bucket = bucket
        self.options = {"endpoint_url": self.endpoint, "aws_access_key_id": "testing",
                        "aws_secret_access_key": "testing", "region_name": "us-east-1"}
        self.client().create_bucket(Bucket=bucket)

    def client(self):
        import boto3

        return boto3.client("s3", **s3_client_kwargs(self.options))

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def env(self) -> dict[str, str]:
        """The same settings as environment variables (what botocore reads when storage_options are absent)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def s3_round_trip(rank: int, world_size: int, root: str, opts: dict[str, Any], method: str,
                  bits: int | None) -> dict[str, bool]:
    """Baseline + 3 deltas on S3, restored into a fresh model; then GC and torn-directory cleanup on S3.

    After the round trip rank 0 drops a torn rank file at the next id (a crash mid-save);
    a new Checkpointer with policy ``full`` and ``keep_last: 1`` must skip that id, commit
    a baseline, and leave exactly that checkpoint and index.json under the prefix.
    """
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    checks: dict[str, bool] = {}
    codec = codec_of(method, bits)
    dmp, specs, opt = build(world_size)
    config = make_config(root, "consecutive", method, bits, storage_options=opts)
    ckpt = Checkpointer(dmp, config, dense_optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    kinds = []
    for step in range(1, 5):
        train(dmp, specs, opt, 2, gen)
        kinds.append(ckpt.save(step).wait().kind)
    checks["baseline then 3 deltas"] = kinds == ["baseline", "delta", "delta", "delta"]
    live = local_state(dmp, opt)
    ckpt.close()
    fresh, _, opt2 = build(world_size, seed=5)
    checks["fresh model differs before restore"] = bool(compare(local_state(fresh, opt2), live, codec))
    restorer = Checkpointer(fresh, config, dense_optimizer=opt2)
    checks["restore returns the last step"] = restorer.restore() == 4
    restorer.close()
    checks["restored state equals the live model"] = not compare(local_state(fresh, opt2), live, codec, False)

    storage = Storage(root, opts)
    try:
        if rank == 0:
            storage.write("ckpt-00000004/rank-00000.bin", b"half a rank file of a save that crashed")
        dist.barrier()
        ckpt = Checkpointer(dmp, make_config(root, "full", method, bits, storage_options=opts, keep_last=1),
                            dense_optimizer=opt)
        train(dmp, specs, opt, 1, gen)
        info = ckpt.save(5).wait()
        ckpt.close()
        checks["torn id skipped"] = info.id == 5 and info.kind == "baseline"
        dist.barrier()
        checks["GC and cleanup on S3 leave one checkpoint"] = sorted(storage.list_dirs()) == ["ckpt-00000005"]
        after = local_state(dmp, opt)
        fresh2, _, opt3 = build(world_size, seed=6)
        r2 = Checkpointer(fresh2, config, dense_optimizer=opt3)
        checks["restore after GC"] = r2.restore() == 5 and not compare(local_state(fresh2, opt3), after, codec, False)
        r2.close()
    finally:
        storage.close()
    return checks


def s3_kill_suite(moto: Moto, side: str, kills: int, schedule=None, seed: int = 0) -> dict[str, Any]:
    suite = KillSuite(f"s3://{moto.bucket}/kills-{seed}", side, opts=moto.options,
                      groups=(("consecutive", "none", None), ("intermittent", "adaptive", 4)), seed=seed)
    return suite.run(kills, schedule)


# ---------------------------------------------------------------------- main


# ---------------------------------------------------------------------- single-rank kills

# (point, rank): the commit protocol's points on the ranks they fire on (commit and GC run on rank 0 only).
SINGLE_POINTS = (("write.mid", 0), ("write.mid", 1), ("write.after", 0), ("write.after", 1),
                 ("commit.before_manifest", 0), ("commit.after_manifest", 0), ("gc.before", 0), ("gc.mid", 0))
# Where the c10d store lives: a file store that outlives every rank (torchrun's agent store), or rank 0's
# process (init_method tcp://, as env:// launches by srun or mpirun host it): it dies with rank 0.
LAUNCHERS = ("agent_store", "store_in_rank0")


def _single_kill_worker(rank: int, world_size: int, p: dict[str, Any]) -> dict[str, Any]:
    """Saves after every step with one fault armed; the survivor of the kill goes on alone until its save or a
    collective fails, then leaves without a collective (its peer is gone): nobody reaps it."""
    from cnr_torchrec import Checkpointer, SaveFailedError
    from cnr_torchrec.ckpt import fault_injection as faults

    dmp, specs, opt = build(world_size, seed=p["seed"])
    install_ref_hook(p["side"], rank, dmp, opt)
    config = make_config(p["root"], "consecutive", "none", None, save_timeout_s=p["timeout_s"],
                         keep={"checkpoints": 2})
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    faults.configure(p["fault"])
    gen = torch.Generator().manual_seed(p["seed"] * 7 + rank)
    out: dict[str, Any] = {"commits": [], "failed": None, "error": None}
    try:
        for step in range(1, p["saves"] + 1):
            train(dmp, specs, opt, 1, gen)
            try:
                out["commits"].append(ck.save(step).wait().id)
            except SaveFailedError as e:
                out["failed"] = str(e)
                break
    except Exception as e:  # noqa: BLE001 - a collective with the dead peer
        out["error"] = f"{type(e).__name__}: {e}"
    write_json(os.path.join(p["phase_dir"], f"single{rank}.json"), out)
    os._exit(0)  # no collective with the dead peer, no teardown


def _restore_check_worker(rank: int, world_size: int, root: str, side: str) -> dict[str, Any]:
    """A fresh job's restore of ``root``: the id it took and where its state differs from that id's reference."""
    from cnr_torchrec import Checkpointer

    seen = spy_restored()
    dmp, _, opt = build(world_size, seed=99)
    config = make_config(root, "consecutive", "none", None)
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    ck.restore()
    restored = seen["ids"][-1]
    ck.close()
    return {"restored": restored, "mismatch": compare(local_state(dmp, opt), load_ref(side, restored, rank), None)[:5]}


def missing_files(root: str, committed: list[int]) -> list[str]:
    """Payload files that a committed manifest names and that are not there, or of another size (read as plain
    JSON and file sizes, without cnr_torchrec)."""
    out = []
    for i in committed:
        body = read_body(root, None, i)
        if "parts" in body:  # format 7: each rank's report is a part of its own, which must be there too
            reports = []
            for r in range(len(body["parts"])):
                part = os.path.join(root, f"ckpt-{i:08d}", f"rank-{r:05d}.json")
                if not os.path.isfile(part) or os.path.getsize(part) != body["parts"][r]["nbytes"]:
                    out.append(os.path.relpath(part, root))
                    continue
                with open(part) as f:
                    reports.append(json.load(f))
        else:
            reports = body["ranks"]
        for r in reports:
            stem = r["file"].removesuffix(".bin")
            for k, c in enumerate(r["chunks"]):
                rel = r["file"] if k == 0 else f"{stem}.{k}.bin"
                path = os.path.join(root, rel)
                if not os.path.isfile(path) or os.path.getsize(path) != c["nbytes"]:
                    out.append(rel)
    return out


def single_rank_kills(work: str, rounds: int, *, saves: int = 4, seed: int = 0, timeout_s: float = 4.0,
                      points: tuple = SINGLE_POINTS, launchers: tuple = LAUNCHERS, world_size: int = 2,
                      restore_timeout_s: float = 120.0, verbose: bool = False) -> dict[str, Any]:
    """One rank SIGKILLed at each commit-protocol point (``points``) under each launcher, ``rounds`` times, on
    its own root. The other ranks are never reaped: each must leave by itself (its save's wait for rank 0, or a
    collective with the dead rank, fails). Then every committed checkpoint must have every file its manifest
    names, and a fresh job of ``world_size`` ranks must restore the newest committed one, every rank equal to
    its reference."""
    rng = random.Random(seed)
    trials = []
    for n in range(rounds):
        for launcher in launchers:
            for point, rank in points:
                nth = 2 if point.startswith("gc.") else rng.randint(2, saves)  # gc: a chain to collect first
                base = os.path.join(work, f"single-{n}-{launcher}-{point}-r{rank}")
                root, side, pdir = os.path.join(base, "root"), os.path.join(base, "side"), os.path.join(base, "ph")
                os.makedirs(side)
                spec = {"root": root, "side": side, "phase_dir": pdir, "seed": 1000 * n + len(trials), "saves": saves,
                        "fault": f"{point}:rank={rank}:nth={nth}", "timeout_s": timeout_s}
                init = None if launcher == "agent_store" else f"tcp://127.0.0.1:{_free_port()}"
                procs = start_ranks(_single_kill_worker, world_size, (spec,), pdir, init=init)
                deadline = time.monotonic() + 30 + 3 * timeout_s + 6 * world_size  # the imports, on 2 cores
                while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
                    mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.5)
                hung = [r for r, p in enumerate(procs) if p.exitcode is None]
                exits = reap(procs)
                found = scan(root)
                committed = sorted(i for i, has in found.items() if has)
                t = {"launcher": launcher, "point": point, "rank": rank, "nth": nth, "fired": exits[rank] == -9,
                     "survivor_exit": [e for r, e in enumerate(exits) if r != rank], "survivor_hung": bool(hung),
                     "committed": committed,
                     "missing": missing_files(root, committed), "expected": newest_state(root, None, committed)}
                if committed:
                    try:
                        res = run_ranks(_restore_check_worker, world_size, (root, side), timeout=restore_timeout_s)
                        t["restored"] = res[0]["restored"]
                        t["mismatch"] = [m for r in res for m in r["mismatch"]]
                        t["ok"] = {r["restored"] for r in res} == {t["expected"]} and not t["mismatch"]
                        t["ranks_checked"] = len(res)
                    except RuntimeError as e:
                        t["restored"], t["ok"], t["mismatch"] = None, False, [str(e)[-500:]]
                else:
                    t["restored"], t["ok"], t["mismatch"] = None, True, []
                t["ok"] = t["ok"] and not t["missing"] and not t["survivor_hung"]
                trials.append(t)
                if verbose:
                    print(f"  {launcher:<15} {point:<24} rank {rank} nth {nth}: fired {t['fired']}, committed "
                          f"{committed}, missing {t['missing']}, restored {t['restored']}, ok {t['ok']}", flush=True)
                shutil.rmtree(base, ignore_errors=True)
    return {
        "kills": len(trials),
        "fired": sum(t["fired"] for t in trials),
        "ok": sum(t["ok"] for t in trials),
        "committed_missing_a_file": sum(bool(t["missing"]) for t in trials),
        "torn_restores": sum(bool(t["committed"]) and t["restored"] != t["expected"] or bool(t["mismatch"])
                             for t in trials),
        "survivors_hung": sum(t["survivor_hung"] for t in trials),
        "failures": [t for t in trials if not t["ok"]][:10],
    }


def wide_job(work: str, world_size: int, seed: int, verbose: bool) -> dict[str, Any]:
    """A real job at ``world_size`` ranks (the tiny tables, gloo, this machine): it saves, one rank is SIGKILLed
    after writing its part of a save (``write.after``), the others leave on their own, and a fresh job of
    ``world_size`` ranks restores the newest committed checkpoint, every rank's rows against its reference."""
    print(f"a real job at {world_size} ranks: saves, rank {world_size // 3} SIGKILLed after writing its part, a "
          "fresh job restores", flush=True)
    t0 = time.monotonic()
    wide = single_rank_kills(work, 1, saves=3, seed=seed, points=(("write.after", world_size // 3),),
                             launchers=("agent_store",), world_size=world_size, timeout_s=10.0,
                             restore_timeout_s=900.0, verbose=verbose)
    wide["seconds"] = round(time.monotonic() - t0, 1)
    print(f"  ok {wide['ok']}/{wide['kills']}, committed checkpoints missing a file "
          f"{wide['committed_missing_a_file']}, torn restores {wide['torn_restores']}; {wide['seconds']} s",
          flush=True)
    for f in wide["failures"]:
        print("   ", f)
    return wide


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_suite(suite: KillSuite, kills: int, verbose: bool) -> dict[str, Any]:
    """``suite.run(kills)``'s summary with its ``seconds``, after printing the harness's first errors."""
    t0 = time.monotonic()
    out = suite.run(kills, progress=verbose)
    out["seconds"] = round(time.monotonic() - t0, 1)
    for e in suite.errors[:5]:
        print(e)
    return out


def memory_kill_suite(work: str, kills: int, seed: int, verbose: bool) -> dict[str, Any]:
    """The kill suite on the groups that keep memory images: restarts take an image where it is sealed for the
    newest commit, and each restore is checked like any other."""
    groups = tuple(g for g in GROUPS if g[0] in IMAGE_GROUPS)
    print(f"memory-tier kill suite: {kills} kills on 2 ranks, groups {[g[:2] for g in groups]}", flush=True)
    suite = KillSuite(os.path.join(work, "mkills"), os.path.join(work, "mkills-side"), groups=groups, seed=seed + 1)
    out = run_suite(suite, kills, verbose)
    print(f"  {out['kills']} kills: restores_ok {out['restores_ok']}, torn_restores {out['torn_restores']}, "
          f"lost_commits {out['lost_commits']}; restores with a rank from memory "
          f"{out['restores_with_a_rank_from_memory']}, mixed {out['mixed_restores']}, wrong from memory "
          f"{out['wrong_restores_from_memory']}; by point {out['kills_by_point']}; {out['seconds']} s", flush=True)
    for f in out["failures"]:
        print("   ", f)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--memory-kills", type=int, default=50,
                    help="kills on the groups that keep memory images (residual; plain with memory_tier: on)")
    ap.add_argument("--memory-only", action="store_true", help="run the memory-tier kills alone")
    ap.add_argument("--single-rounds", type=int, default=3,
                    help="rounds of single-rank kills: each commit-protocol point under both launchers")
    ap.add_argument("--single-only", action="store_true", help="run the single-rank kills alone")
    ap.add_argument("--wide-ranks", type=int, default=16,
                    help="the real job at this many ranks: saves, one rank SIGKILLed, a fresh job restores")
    ap.add_argument("--wide-only", action="store_true", help="run the job at --wide-ranks alone")
    ap.add_argument("--s3-kills", type=int, default=4, help="kills on the S3 root (moto)")
    ap.add_argument("--positions", type=int, default=4, help="byte-flip positions per file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    work = tempfile.mkdtemp(prefix="cnr-reliability-")
    out: dict[str, Any] = {}
    t_all = time.monotonic()
    try:
        wide = wide_job(os.path.join(work, "wide"), args.wide_ranks, args.seed, args.verbose)
        if args.wide_only:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"wide_job": wide}, f, indent=1)
            return 0 if wide["ok"] == wide["kills"] else 1
        print(f"single-rank kills: {args.single_rounds} round(s) of {len(SINGLE_POINTS)} points x {list(LAUNCHERS)}",
              flush=True)
        t0 = time.monotonic()
        single = single_rank_kills(os.path.join(work, "single"), args.single_rounds, seed=args.seed,
                                   verbose=args.verbose)
        single["seconds"] = round(time.monotonic() - t0, 1)
        print(f"  {single['kills']} kills ({single['fired']} fired): ok {single['ok']}, committed checkpoints "
              f"missing a file {single['committed_missing_a_file']}, torn restores {single['torn_restores']}, "
              f"survivors hung {single['survivors_hung']}; {single['seconds']} s", flush=True)
        for f in single["failures"]:
            print("   ", f)
        if args.single_only:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"single_rank_kills": single}, f, indent=1)
            return 0 if single["ok"] == single["kills"] else 1
        memory = memory_kill_suite(work, args.memory_kills, args.seed, args.verbose)
        if args.memory_only:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"memory_kills": memory}, f, indent=1)
            ok = memory["torn_restores"] == 0 and memory["wrong_restores_from_memory"] == 0
            return 0 if ok and not memory["harness_errors"] else 1
        print(f"kill suite: {args.kills} kills on 2 ranks, groups {[g[:2] for g in GROUPS]}", flush=True)
        suite = KillSuite(os.path.join(work, "kills"), os.path.join(work, "kills-side"), seed=args.seed)
        kills = run_suite(suite, args.kills, args.verbose)
        print(f"  {kills['kills']} kills: restores_ok {kills['restores_ok']}, torn_restores {kills['torn_restores']}, "
              f"lost_commits {kills['lost_commits']}, restart saves ok {kills['restart_saves_ok']}; "
              f"{kills['named_fired']} at named points, {kills['random_kills']} random, {kills['late_kills']} late; "
              f"{kills['kills_with_torn_dirs']} left torn directories; {kills['seconds']} s "
              f"(median phase {kills['median_phase_s']:.2f} s)", flush=True)
        for f in kills["failures"]:
            print("   ", f)

        print("corruption matrix (2 ranks, fail + fallback, verify_root)", flush=True)
        t0 = time.monotonic()
        per_rank = run_ranks(corruption_matrix, 2, (os.path.join(work, "corrupt"), args.positions), timeout=600)
        corrupt = summarize_corruption(per_rank)
        corrupt["seconds"] = round(time.monotonic() - t0, 1)
        print(f"  {corrupt['corruptions_detected']}/{corrupt['corruptions_injected']} detected, "
              f"{corrupt['corruptions_read_around']} read around (restore exact, verify_root names them) "
              f"({corrupt['fallbacks_after_partial_apply']} fallbacks after a partial apply); "
              f"verify_root {'checked' if corrupt['verify_available'] else 'not available'}; "
              f"{corrupt['seconds']} s", flush=True)
        for m in corrupt["misses"][:10]:
            print("   ", m)

        print("ENOSPC", flush=True)
        enospc = run_ranks(enospc_scenario, 2, (os.path.join(work, "enospc"),), timeout=300)
        enospc_ok = all(all(r.values()) for r in enospc)
        for name in enospc[0]:
            print(f"  {name}: {[r[name] for r in enospc]}")

        print("S3 (moto): round trip with fp32 and adaptive 4-bit rows, and kills", flush=True)
        moto = Moto()
        try:
            s3 = {}
            for method, bits in (("none", None), ("adaptive", 4)):
                res = run_ranks(s3_round_trip, 2, (f"s3://{moto.bucket}/rt-{method}", moto.options, method, bits),
                                timeout=300)
                s3[method] = res
                for name in res[0]:
                    print(f"  {method}: {name}: {[r[name] for r in res]}")
            s3_ok = all(all(r.values()) for res in s3.values() for r in res)
            s3_kills = s3_kill_suite(moto, os.path.join(work, "s3-side"), args.s3_kills, seed=args.seed)
            print(f"  S3 kills: {s3_kills['kills']}, restores_ok {s3_kills['restores_ok']}, torn "
                  f"{s3_kills['torn_restores']}, lost {s3_kills['lost_commits']}", flush=True)
        finally:
            moto.close()

        out = {
            "kills": kills["kills"],
            "restores_ok": kills["restores_ok"],
            "single_rank_kills": single["kills"],
            "single_rank_ok": single["ok"],
            "single_rank_committed_missing_a_file": single["committed_missing_a_file"],
            "wide_job_ranks": args.wide_ranks,
            "wide_job_ok": wide["ok"] == wide["kills"],
            "memory_kills": memory["kills"],
            "memory_restores_ok": memory["restores_ok"],
            "memory_wrong_restores_from_memory": memory["wrong_restores_from_memory"],
            "memory_restores_with_a_rank_from_memory": memory["restores_with_a_rank_from_memory"],
            "torn_restores": kills["torn_restores"],
            "lost_commits": kills["lost_commits"],
            "corruptions_injected": corrupt["corruptions_injected"],
            "corruptions_detected": corrupt["corruptions_detected"],
            "corruptions_read_around": corrupt["corruptions_read_around"],
            "enospc_ok": enospc_ok,
            "s3_roundtrip_ok": s3_ok,
            "s3_kills": s3_kills["kills"],
            "s3_restores_ok": s3_kills["restores_ok"],
            "details": {"kills": kills, "single_rank_kills": single, "wide_job": wide, "memory_kills": memory, "corruption": corrupt,
                        "enospc": enospc, "s3_kills": s3_kills},
            "seconds": round(time.monotonic() - t_all, 1),
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("work directory kept:", work)
    print("\nsummary: " + json.dumps({k: v for k, v in out.items() if k != "details"}))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    good = (out.get("torn_restores") == 0 and out.get("lost_commits") == 0
            and out.get("restores_ok") == out.get("kills")
            and out.get("memory_restores_ok") == out.get("memory_kills")
            and out.get("single_rank_ok") == out.get("single_rank_kills")
            and out.get("wide_job_ok") is True
            and out.get("memory_wrong_restores_from_memory") == 0
            and out.get("corruptions_detected", 0) + out.get("corruptions_read_around", 0)
            == out.get("corruptions_injected")
            and out.get("enospc_ok") and out.get("s3_roundtrip_ok"))
    return 0 if good else 1


if __name__ == "__main__":
    # Run as a script, this file is __main__; the forked ranks need its functions under an importable
    # name, so everything goes through the module imported as "reliability".
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import reliability

    sys.exit(reliability.main())
