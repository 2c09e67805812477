"""The training job: a sharded DLRM on the synthetic Criteo stream, checkpointed by Check-N-Run.

Launch with torchrun::

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 -m cnr_dlrm.train \\
        --config configs/demo.yaml [--set train.steps=400 ...] [--fail-at-step 120 --fail-rank 1] [--debug]

At start the job restores the newest committed checkpoint under ``checkpoint.root`` (a fresh
start when there is none), trains through ``TrainPipelineSparseDist`` with a save every
``train.checkpoint_interval`` steps, evaluates on a held-out stream, and rank 0 prints a
summary and writes ``report.json``. A named error (a CnrError: another model's checkpoint, a
corrupt one...) is printed once per job as one line (:mod:`cnr_dlrm.failure`); ``--debug`` adds
the tracebacks. docs/train.md describes the config and the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.errors import CheckpointError, CheckpointNotFoundError, CnrError, ConfigError, one_line
from cnr_torchrec.track.tbe_cache import flush_caches

from cnr_dlrm.config import JobConfig, TrainConfig, apply_overrides, load_job_config
from cnr_dlrm.data import ClickDataset, ResumableReader, SyntheticCriteo, make_loader
from cnr_dlrm.dlrm import build_model, build_plan, dense_parameters, make_sharder, table_features
from cnr_dlrm.failure import FailureReport
from cnr_dlrm.launch import init_distributed

__all__ = ["JobConfig", "Journal", "TrainConfig", "apply_overrides", "auc", "evaluate", "format_summary",
           "load_job_config", "logloss", "main", "run"]

log = logging.getLogger(__name__)

JOURNAL = "job.json"
REPORT = "report.json"


# ---------------------------------------------------------------------- metrics


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy (nats) of ``logits`` against 0/1 ``labels``."""
    return float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN without both classes."""
    scores = scores.double().flatten()
    pos = labels.flatten() > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    first = counts.cumsum(0) - counts  # 0-based rank of each distinct value's first occurrence
    avg_rank = first.double() + (counts.double() + 1) / 2  # 1-based average rank of the tied group
    rank_sum = avg_rank[inverse][pos].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


# ---------------------------------------------------------------------- journal


class Journal:
    """Rank 0's record of the job across restarts: restores, and every checkpoint it saw committed.

    Kept as ``job.json`` in the checkpoint root (through the same storage as the checkpoints),
    because a checkpoint cannot count the restores made from it, and garbage collection
    deletes old manifests.
    """

    def __init__(self, config: CheckpointConfig) -> None:
        from cnr_torchrec.ckpt.format.bytes.storage import Storage

        self._storage = Storage(config.root, config.storage_options)
        self.restores = 0
        self.restored_from: list[dict[str, Any]] = []
        self.checkpoints: dict[int, dict[str, Any]] = {}
        self.started_unix = time.time()
        try:
            doc = json.loads(self._storage.read(JOURNAL))
        except CheckpointNotFoundError:
            self.flush()  # a new job: keep its start time even if it dies before its first checkpoint
            return
        except ValueError:
            log.warning("%s under %s is not valid JSON; starting a new journal", JOURNAL, config.root)
            return
        self.started_unix = float(doc.get("started_unix", self.started_unix))
        self.restores = int(doc.get("restores", 0))
        self.restored_from = list(doc.get("restored_from", []))
        self.checkpoints = {int(c["id"]): c for c in doc.get("checkpoints", [])}

    def record(self, info: Any, total_rows: int) -> None:
        """Adds a committed checkpoint (a CheckpointInfo) and rewrites the journal."""
        if info is None or info.id in self.checkpoints:
            return
        self.checkpoints[info.id] = {
            "id": info.id,
            "step": info.step,
            "kind": info.kind,
            "method": info.codec.get("method"),
            "bits": info.codec.get("bits"),
            "rows_written": info.rows_written,
            "total_rows": total_rows,
            "dirty_fraction": info.rows_written / total_rows if total_rows else 0.0,
            "nbytes": info.nbytes,
            "stall_ms": float(info.stall_ms),
            "write_ms": float(info.write_ms),
        }
        self.flush()

    def record_restore(self, ckpt_id: int, step: int, incarnation: int) -> None:
        self.restores += 1
        self.restored_from.append({"id": ckpt_id, "step": step, "incarnation": incarnation})
        self.flush()

    def flush(self) -> None:
        doc = {"format": "cnr-job", "version": 1, "started_unix": self.started_unix, "restores": self.restores,
               "restored_from": self.restored_from,
               "checkpoints": [self.checkpoints[i] for i in sorted(self.checkpoints)]}
        self._storage.write_atomic(JOURNAL, json.dumps(doc, indent=1).encode())

    def write(self, path: str, data: bytes) -> None:
        self._storage.write_atomic(path, data)

    def close(self) -> None:
        self._storage.close()


# ---------------------------------------------------------------------- the job


def _dense_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def full_snapshot_nbytes(table_rows: list[int], dim: int, embedding_optimizer: str,
                         dense: list[torch.nn.Parameter], dense_opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of a full fp32 snapshot: tables, their optimizer state, dense parameters and dense optimizer state."""
    rows = sum(table_rows)
    state_per_row = {"rowwise_adagrad": 1, "adagrad": dim, "sgd": 0}[embedding_optimizer]
    parts = {
        "embedding": rows * dim * 4,
        "embedding_optimizer": rows * state_per_row * 4,
        "dense": sum(p.numel() for p in dense) * 4,
        "dense_optimizer": _tensor_bytes(dense_opt.state_dict()["state"]),
    }
    parts["total"] = sum(parts.values())
    return parts


class _Bar:
    """A tqdm bar on rank 0 only (no-op elsewhere), ticking on its own while a blocking call runs."""

    def __init__(self, enabled: bool, **kwargs: Any) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(mininterval=0.5, dynamic_ncols=True, file=sys.stderr, **kwargs)
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def tick_while(self) -> _Bar:
        if self.bar is not None:
            def run() -> None:
                while not self._stop.wait(0.5):
                    self.bar.refresh()

            self._ticker = threading.Thread(target=run, daemon=True)
            self._ticker.start()
        return self

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.bar is not None:
            self.bar.close()


def _local_state(dmp: torch.nn.Module, dense: list[tuple[str, torch.nn.Parameter]],
                 dense_opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's table shards, their optimizer state, the dense parameters and dense optimizer state."""
    tracker = dmp.dirty_tracker
    flush_caches(tracker.tbes())  # fused_uvm_caching: the weights behind the cache, brought up to date
    out: dict[str, torch.Tensor] = {}
    for table in tracker.tables():
        for kernel, shard in tracker.shards(table):
            tag = f"{table}/rows{shard.rows[0]}-{shard.rows[1]}/cols{shard.cols[0]}-{shard.cols[1]}"
            out[f"emb/{tag}"] = kernel.tbe.split_embedding_weights()[shard.local_index].detach().clone()
            states = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
            for j, s in enumerate(states[shard.local_index] if states else []):
                out[f"emb_state{j}/{tag}"] = s.detach().clone()
    for name, p in dense:
        out[f"dense/{name}"] = p.detach().clone()
    for pid, st in dense_opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"dense_opt/{pid}/{k}"] = v.detach().clone()
    return out


def _committed(ckpt: Any) -> list[Any]:
    """``ckpt.list()``, or what can be listed: a corrupt manifest is restore's business, not the report's."""
    try:
        return ckpt.list()
    except CheckpointError as e:
        log.warning("cannot list the committed checkpoints (%s); the report may miss some", e)
        return []


def _restore(ckpt: Any, rank: int, journal: Journal | None, total_rows: int, incarnation: int) -> int:
    """Restores the newest committed checkpoint; 0 when there is none."""
    infos = _committed(ckpt) if rank == 0 else []
    if journal is not None:
        for info in infos:  # commits a killed incarnation never got to record
            journal.record(info, total_rows)
    chain = len(infos[-1].chain) if infos else 0
    bar = _Bar(rank == 0 and chain > 0, total=chain, desc="restore", unit="ckpt").tick_while()
    try:
        # "drop": onto another world size the per-rank reader state cannot be mapped; the caller then
        # reads each rank's stream from the restored step, which repeats no sample either.
        step = ckpt.restore(per_rank_state="drop")
        bar.update(chain)
    except CheckpointNotFoundError:
        return 0
    finally:
        bar.close()  # before an error's line, which would otherwise land on the bar's
    if rank == 0 and journal is not None:
        restored = [i for i in infos if i.step == step]
        journal.record_restore(restored[-1].id if restored else -1, step, incarnation)
    return step


@dataclasses.dataclass
class _Job:
    """What one run trains and checkpoints, built once on every rank."""

    stream: SyntheticCriteo
    model_rows: list[int]  # rows of each table of the model (a table shared by several features counted once)
    dmp: Any  # CheckNRunDMP
    dense: list[tuple[str, torch.nn.Parameter]]
    dense_opt: torch.optim.Optimizer
    dataset: ClickDataset
    reader: ResumableReader
    ckpt: Any  # Checkpointer
    journal: Journal | None  # rank 0's

    @property
    def total_rows(self) -> int:
        return sum(self.model_rows)


def run(cfg: JobConfig, args: argparse.Namespace, device: torch.device, incarnation: int = 0) -> dict[str, Any] | None:
    """Trains, evaluates and reports. Returns the report on rank 0 (None elsewhere)."""
    t_start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    job = _build_job(cfg, device, rank, world)
    start = _resume(job, cfg, rank, incarnation)
    t_train = time.perf_counter()
    first_loss, last_loss, pending = _train(job, cfg, args, device, start, rank, incarnation)
    train_s = time.perf_counter() - t_train
    job.ckpt.wait()
    for handle in pending:
        _settle(handle, job.journal, job.total_rows)
    ev = evaluate(job.dmp, job.stream, rank, world, cfg.data.batch_size, cfg.train.eval_batches, device)
    if args.dump_state:
        os.makedirs(args.dump_state, exist_ok=True)
        torch.save(_local_state(job.dmp, job.dense, job.dense_opt),
                   os.path.join(args.dump_state, f"rank-{rank:05d}.pt"))
    committed = _committed(job.ckpt) if rank == 0 else []
    job.ckpt.close()
    if rank != 0:
        return None
    assert job.journal is not None
    for info in committed:
        job.journal.record(info, job.total_rows)
    snapshot = full_snapshot_nbytes(job.model_rows, cfg.model.embedding_dim, cfg.train.embedding_optimizer,
                                    [p for _, p in job.dense], job.dense_opt)
    report = {
        "format": "cnr-report",
        "version": 1,
        "world_size": world,
        "full_snapshot_nbytes": snapshot["total"],
        "checkpoints": [job.journal.checkpoints[i] for i in sorted(job.journal.checkpoints)],
        "restores": job.journal.restores,
        "eval": {"logloss": ev["logloss"], "auc": ev["auc"]},
        "full_snapshot": snapshot,
        "restored_from": job.journal.restored_from,
        "eval_detail": ev,
        "steps": cfg.train.steps,
        "start_step": start,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "train_s": train_s,
        "wall_s": time.perf_counter() - t_start,
        "job_wall_s": time.time() - job.journal.started_unix,
        "policy": cfg.checkpoint.policy,
        "config": _plain(cfg),
    }
    _write_report(report, job.journal, cfg, args)
    return report


def _build_job(cfg: JobConfig, device: torch.device, rank: int, world: int) -> _Job:
    """The data, the sharded model with its dense optimizer, the resumable reader and the Checkpointer."""
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP, Checkpointer

    tc = cfg.train
    stream = SyntheticCriteo(cfg.data)
    model_rows = [rows for rows, _ in table_features(cfg.model, stream.table_rows, stream.keys).values()]
    model = build_model(cfg.model, stream.table_rows, stream.keys, device)
    sharder = make_sharder(tc.embedding_optimizer, tc.embedding_lr)
    plan = build_plan(model, sharder, world, cfg.model.row_wise_min_rows, device.type)
    # will_restore: a restarted job's tables wait for its restore instead of being filled with initial values first.
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device, plan=plan,
                       sharders=[sharder], will_restore=cfg.checkpoint)
    dense = dense_parameters(dmp, dmp.dirty_tracker.module_fqns())
    dense_opt = _dense_optimizer(tc, [p for _, p in dense])
    dataset = ClickDataset(stream, rank, cfg.data.batch_size, tc.steps, split="train")
    reader = ResumableReader(make_loader(dataset, cfg.data.num_workers))
    ckpt = Checkpointer(dmp, cfg.checkpoint, dense_optimizer=dense_opt, extra_state={"reader": reader})
    journal = Journal(cfg.checkpoint) if rank == 0 else None
    return _Job(stream, model_rows, dmp, dense, dense_opt, dataset, reader, ckpt, journal)


def _resume(job: _Job, cfg: JobConfig, rank: int, incarnation: int) -> int:
    """Restores the newest checkpoint, if any, and puts the reader at its step. Returns the step."""
    steps = cfg.train.steps
    start = _restore(job.ckpt, rank, job.journal, job.total_rows, incarnation)
    if start > steps:
        raise CheckpointError(f"the checkpoint is at step {start}, past train.steps={steps}; raise train.steps "
                              "or use a new checkpoint.root")
    if start and job.reader.trained != start:
        # Another world size: per-rank reader state was not restored; read each stream from `start`.
        log.warning("rank %d: reader state not restored (it says %d batches, the checkpoint %d); reading from "
                    "batch %d", rank, job.reader.trained, start, start)
        job.reader.loader = make_loader(torch.utils.data.Subset(job.dataset, range(start, steps)),
                                        cfg.data.num_workers)
        job.reader.trained = start
    return start


def _train(job: _Job, cfg: JobConfig, args: argparse.Namespace, device: torch.device, start: int, rank: int,
           incarnation: int) -> tuple[float | None, float | None, list[Any]]:
    """Trains from ``start`` to ``train.steps``, saving as the config says. Returns the first and last loss
    (rank 0's; None elsewhere or without a step) and the handles of the saves still in flight."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    tc, ckpt = cfg.train, job.ckpt
    handles: list[Any] = []
    auto_interval = cfg.checkpoint.interval is not None
    first_loss = last_loss = None
    if start < tc.steps:
        pipeline = TrainPipelineSparseDist(job.dmp, job.dense_opt, device, execute_all_batches=True)
        bar = _Bar(rank == 0, total=tc.steps, initial=start, desc="train", unit="step")
        try:
            for step in range(start + 1, tc.steps + 1):
                if step == args.fail_at_step and rank == args.fail_rank and incarnation == 0:
                    _kill_self(rank, step)
                try:
                    loss, _, _ = pipeline.progress(job.reader)
                except StopIteration:
                    raise CheckpointError(
                        f"rank {rank}: the reader ran out before step {step} of {tc.steps}; its restored state "
                        f"does not match the checkpoint (use a new checkpoint.root)"
                    ) from None
                job.reader.step_done()
                if rank == 0:
                    last_loss = float(loss)
                    first_loss = last_loss if first_loss is None else first_loss
                # checkpoint.interval (a number or auto) hands the choice to the Checkpointer; called every step.
                due = ckpt.should_save(step) if auto_interval else step % tc.checkpoint_interval == 0
                if due or step == tc.steps:
                    handles.append(ckpt.save(step))
                while handles and handles[0].done():
                    _settle(handles.pop(0), job.journal, job.total_rows)
                bar.update(1, loss=f"{last_loss:.4f}" if last_loss is not None else "")
        finally:
            bar.close()  # before an error's line, which would otherwise land on the bar's
        pipeline.detach()
    return first_loss, last_loss, handles


def _kill_self(rank: int, step: int) -> None:
    """The injected failure of ``--fail-at-step``: this rank dies as a crashed process would."""
    sys.stderr.write(f"\n[rank {rank}] injected failure at step {step}: SIGKILL\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _write_report(report: dict[str, Any], journal: Journal, cfg: JobConfig, args: argparse.Namespace) -> None:
    """Writes the report to ``--report``, or beside the checkpoints; records where in ``report_path``."""
    data = json.dumps(report, indent=1).encode()
    if args.report:
        os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        with open(args.report, "wb") as f:
            f.write(data)
        report["report_path"] = args.report
    else:
        journal.write(REPORT, data)
        report["report_path"] = f"{cfg.checkpoint.root.rstrip('/')}/{REPORT}"
    journal.close()


def _settle(handle: Any, journal: Journal | None, total_rows: int) -> None:
    try:
        info = handle.wait()
    except CheckpointError as e:  # SaveFailedError: logged; the next save is a baseline
        log.warning("%s", e)
        return
    if journal is not None:
        journal.record(info, total_rows)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


@torch.no_grad()
def evaluate(dmp: torch.nn.Module, stream: SyntheticCriteo, rank: int, world: int, batch_size: int,
             batches: int, device: torch.device) -> dict[str, Any]:
    """Logloss and AUC of the model on every rank's held-out stream (eval lookups mark no rows dirty)."""
    dmp.eval()
    logits, labels, teacher = [], [], []
    bar = _Bar(rank == 0, total=batches, desc="eval", unit="batch")
    for i in range(batches):
        batch, t_logits = stream.generate(rank, i * batch_size, (i + 1) * batch_size, split="eval")
        _, (_, out, lab) = dmp(batch.to(device))
        logits.append(out.float().cpu())
        labels.append(lab.float().cpu())
        teacher.append(t_logits.float())
        bar.update(1)
    bar.close()
    dmp.train()
    local = torch.stack([torch.cat(logits), torch.cat(labels), torch.cat(teacher)])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered, dim=1)
    s, y, t = allv[0], allv[1], allv[2]
    rate = float(y.mean())
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)) if 0 < rate < 1 else 0.0
    return {
        "logloss": logloss(s, y),
        "auc": auc(s, y),
        "samples": int(y.numel()),
        "label_rate": rate,
        "label_entropy": entropy,
        "teacher_logloss": logloss(t, y),
        "teacher_auc": auc(t, y),
    }


# ---------------------------------------------------------------------- summary


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def format_summary(report: dict[str, Any]) -> str:
    """The table rank 0 prints at the end of a job."""
    lines = []
    ck = report["checkpoints"]
    ev = report["eval_detail"]
    resumed = f", resumed at step {report['start_step']}" if report["start_step"] else ""
    lines.append(f"== cnr_dlrm.train: {report['world_size']} ranks, {report['steps']} steps{resumed}, "
                 f"policy {report['policy']}; {report['job_wall_s']:.1f} s since the job's first start, "
                 f"{report['wall_s']:.1f} s in this incarnation")
    lines.append("")
    lines.append(f"{'id':>4} {'step':>6} {'kind':<9} {'codec':<14} {'rows':>9} {'dirty':>7} {'bytes':>12} "
                 f"{'stall ms':>9} {'write ms':>9}")
    for c in ck:
        codec = f"{c['method']}" + (f" {c['bits']}-bit" if c["bits"] is not None else "")
        lines.append(f"{c['id']:>4} {c['step']:>6} {c['kind']:<9} {codec:<14} {c['rows_written']:>9} "
                     f"{c['dirty_fraction']:>7.1%} {c['nbytes']:>12,} {c['stall_ms']:>9.1f} {c['write_ms']:>9.1f}")
    lines.append("")
    lines.append(f"{'kind':<9} {'count':>5} {'bits':>5} {'rows':>10} {'bytes':>14} {'stall ms (mean/max)':>20}")
    for kind in ("baseline", "delta"):
        sel = [c for c in ck if c["kind"] == kind]
        if not sel:
            continue
        bits = sorted({str(c["bits"]) if c["bits"] is not None else "32" for c in sel})
        stalls = [c["stall_ms"] for c in sel]
        lines.append(f"{kind:<9} {len(sel):>5} {'/'.join(bits):>5} {sum(c['rows_written'] for c in sel):>10} "
                     f"{sum(c['nbytes'] for c in sel):>14,} "
                     f"{sum(stalls) / len(stalls):>10.1f} / {max(stalls):<7.1f}")
    written = sum(c["nbytes"] for c in ck)
    full = report["full_snapshot_nbytes"] * len(ck)
    ratio = f"{full / written:.1f}x less" if written else "n/a"
    lines.append(f"{'total':<9} {len(ck):>5} {'':>5} {sum(c['rows_written'] for c in ck):>10} {written:>14,}")
    lines.append(f"vs full fp32 snapshots: {len(ck)} x {_mb(report['full_snapshot_nbytes'])} = {_mb(full)} "
                 f"-> {_mb(written)} written ({ratio})")
    fs = report["full_snapshot"]
    lines.append(f"  (a full snapshot: tables {_mb(fs['embedding'])}, "
                 f"table optimizer {_mb(fs['embedding_optimizer'])}, "
                 f"dense {_mb(fs['dense'])}, dense optimizer {_mb(fs['dense_optimizer'])})")
    frm = ", ".join(f"checkpoint {r['id']} at step {r['step']}" for r in report["restored_from"]) or "none"
    lines.append(f"restores: {report['restores']} (from: {frm})")
    lines.append(f"eval on {ev['samples']:,} held-out samples: logloss {ev['logloss']:.4f}, AUC {ev['auc']:.4f} "
                 f"(label entropy {ev['label_entropy']:.4f} at rate {ev['label_rate']:.3f}; "
                 f"teacher logloss {ev['teacher_logloss']:.4f}, AUC {ev['teacher_auc']:.4f})")
    lines.append(f"report: {report['report_path']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cnr_dlrm.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="job YAML (sections data, model, train, checkpoint)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config value (parsed as YAML); repeatable")
    p.add_argument("--fail-at-step", type=int, default=None, metavar="S",
                   help="kill --fail-rank with SIGKILL right before step S, in the first incarnation only")
    p.add_argument("--fail-rank", type=int, default=0, metavar="R", help="the rank that fails (default 0)")
    p.add_argument("--report", default=None, metavar="PATH", help="write report.json here instead of the root")
    p.add_argument("--dump-state", default=None, metavar="DIR",
                   help="write each rank's final table shards, optimizer and dense state to DIR/rank-N.pt")
    p.add_argument("--verbose", action="store_true", help="log checkpoint decisions and saves (INFO)")
    p.add_argument("--debug", action="store_true",
                   help="on a named error (CnrError), print each failing rank's traceback before the one-line "
                        "message")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank_env = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_job_config(args.config, args.set)
    except ConfigError as e:
        if rank_env == 0:
            print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, force=True,
                        format=f"[rank {rank_env}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("torchrec", "fbgemm_gpu", "torch.distributed", "torch.fx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if args.fail_at_step is not None and not (1 <= args.fail_at_step <= cfg.train.steps
                                              and 0 <= args.fail_rank < world_env):
        if rank_env == 0:
            print(f"error: --fail-at-step must be in [1, train.steps={cfg.train.steps}] and --fail-rank in "
                  f"[0, {world_env}), got {args.fail_at_step} and {args.fail_rank}", file=sys.stderr)
        return 2
    launch = init_distributed()
    failure = FailureReport(launch.store, launch.round_number, dist.get_rank(), debug=args.debug)
    try:
        report = run(cfg, args, launch.device, launch.incarnation)
        if report is not None:
            print(format_summary(report), flush=True)
        dist.barrier()
    except CnrError as e:  # what to do is in its message: one line, once per job (bugs keep their traceback)
        failure.named(e)
        return 1
    except RuntimeError as e:
        if not any(m in str(e) for m in _PEER_GONE):
            raise
        reporter = failure.reporter()
        if reporter is not None:  # the peer died of a named error, which it printed
            print(f"rank {failure.rank} failed, see rank {reporter}", file=sys.stderr, flush=True)
            return 1
        # A peer died mid-collective (e.g. --fail-at-step): say so in one line; torchrun restarts the group.
        log.error("a peer rank is gone (%s); exiting so that torchrun can restart the group",
                  str(e).splitlines()[0][:160])
        return 1
    finally:
        dist.destroy_process_group()
    return 0


# How gloo reports a peer that died in the middle of a collective.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    code = main()
    # Leave without C++ static destructors: gloo/DDP helper threads have aborted finished processes at
    # interpreter exit, and torchrun would take that non-zero exit for a failure and rerun the job.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
