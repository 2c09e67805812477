"""The Checkpointer: decoupled, differential, quantized saves of a CheckNRunDMP, and restore."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.ckpt.manifest import (
    ckpt_dir,
    committed_ids,
    existing_dir_ids,
    load_manifest,
    manifest_path,
    rank_file,
    seal,
    write_index,
)
from cnr_torchrec.ckpt.planner import ChainState, Decision, decide
from cnr_torchrec.ckpt.restore import restore_chain
from cnr_torchrec.ckpt.save import Staged, stage, write_rank
from cnr_torchrec.ckpt.storage import Storage
from cnr_torchrec.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    SaveFailedError,
)
from cnr_torchrec.quant import get_codec

__all__ = ["Checkpointer", "CheckpointInfo", "SaveHandle"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it."""

    id: int
    step: int
    kind: str
    parent: int | None
    chain: tuple[int, ...]
    policy: str
    nbytes: int
    rows_written: int
    world_size: int
    codec: dict[str, Any]
    stall_ms: float
    write_ms: float

    @classmethod
    def from_manifest(cls, m: dict[str, Any]) -> CheckpointInfo:
        return cls(
            id=m["id"], step=m["step"], kind=m["kind"], parent=m["parent"], chain=tuple(m["chain"]),
            policy=m["policy"], nbytes=m["nbytes"], rows_written=sum(r["rows_written"] for r in m["ranks"]),
            world_size=m["world_size"], codec=m["codec"], stall_ms=max(r["stall_ms"] for r in m["ranks"]),
            write_ms=max(r["write_ms"] for r in m["ranks"]),
        )


def _table_fqns(model: torch.nn.Module, tracker: Any) -> dict[str, str]:
    """Each table's weight name in the unsharded model ("ebc.embedding_bags.t0.weight"), for exports."""
    out = {}
    names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
    for table in tracker.tables():
        module = str(tracker._entry(table)["module"])
        hits = [n for n in names if n.startswith(module + ".") and n.endswith(f".{table}.weight")]
        out[table] = hits[0] if len(hits) == 1 else f"{module}.{table}.weight"
    return out


class SaveHandle:
    """A save in flight. ``wait()`` returns once it is committed (or raises SaveFailedError)."""

    def __init__(self, step: int, decision: Decision | None, future: Future | None, stall_ms: float) -> None:
        self.step = step
        self.decision = decision
        self.stall_ms = stall_ms
        self._future = future

    @property
    def skipped(self) -> bool:
        """True when ``on_busy: skip`` dropped this save; its rows go into the next one."""
        return self._future is None

    @property
    def kind(self) -> str | None:
        return None if self.decision is None else self.decision.kind

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Blocks until the checkpoint is committed. Returns None for a skipped save.

        Raises:
            SaveFailedError: the save did not commit; the previous checkpoint is intact.
        """
        if self._future is None:
            return None
        return self._future.result(timeout)


class Checkpointer:
    """Differential, quantized checkpoints of a :class:`~cnr_torchrec.CheckNRunDMP`.

    Every rank constructs one, with the same config, and calls ``save``/``restore`` at
    the same points. A save blocks training only for the all-gather of dirty counts and
    the copy of the dirty rows to host; encoding and writing run on a background thread
    that coordinates with the other ranks through the c10d store, never the training
    process group.

    Args:
        model: the sharded model; its ``dirty_tracker`` says which rows changed.
        config: see :class:`~cnr_torchrec.ckpt.CheckpointConfig`.
        dense_optimizer: the optimizer of the dense (DDP) parameters, saved in full.
        extra_state: per-rank stateful objects (the data loader...), saved and restored by name.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: CheckpointConfig,
        *,
        dense_optimizer: Any = None,
        extra_state: dict[str, Any] | None = None,
    ) -> None:
        tracker = getattr(model, "dirty_tracker", None)
        if tracker is None:
            raise ConfigError("Checkpointer needs a CheckNRunDMP (a model with a dirty_tracker); wrap the model in it")
        if not isinstance(config, CheckpointConfig):
            raise ConfigError(f"config must be a CheckpointConfig (see cnr_torchrec.load_config), got {type(config)}")
        for name, obj in (extra_state or {}).items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ConfigError(f"extra_state[{name!r}] has no state_dict()/load_state_dict(); pass a Stateful object")
        self.model = model
        self.tracker = tracker
        self.config = config
        self.dense_optimizer = dense_optimizer
        self.extra_state = dict(extra_state or {})
        self.codec = get_codec(config.quantization.method, config.quantization.bits, **config.quantization.params)
        self._state_dtype = getattr(torch, config.quantization.state_dtype)
        self._table_fqns = _table_fqns(model, tracker)
        if config.policy in ("one_shot", "intermittent"):
            tracker.enable_baseline_view()

        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
        self._storage = Storage(config.root, config.storage_options)
        self._bg_storage: Storage | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cnr-save")
        self._inflight: SaveHandle | None = None
        self._store, self._token = self._make_store()
        ids = existing_dir_ids(self._storage) if self.rank == 0 else []
        self._state = ChainState(next_id=self._agree(max(ids, default=-1) + 1))
        self._force_baseline = ""
        self._state_if_failed = self._state
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public

    def save(self, step: int) -> SaveHandle:
        """Takes a checkpoint of ``step``. Returns at once; ``handle.wait()`` waits for the commit.

        Every rank must call it at the same step. Blocks only for the collective
        decision and the copy of the dirty rows to host memory.
        """
        t0 = time.perf_counter()
        if self._inflight is not None and not self._inflight.done() and self.config.on_busy == "wait":
            self._settle(self._inflight)
        busy = self._inflight is not None and not self._inflight.done()
        counts = self._gather_counts(busy)
        if counts is None:
            log.info("save at step %d skipped: the previous save is still writing (on_busy: skip)", step)
            return SaveHandle(step, None, None, (time.perf_counter() - t0) * 1e3)
        if self._inflight is not None:
            self._settle(self._inflight)
        prev, base, held = counts
        decision = decide(
            policy=self.config.policy, state=self._state, step=step, dirty_since_previous=prev,
            dirty_since_baseline=base, held_rows=held, full_shard_fraction=self.config.full_shard_fraction,
            force_baseline=self._force_baseline,
        )
        staged = stage(
            decision, model=self.model, tracker=self.tracker, rank=self.rank, world_size=self.world_size,
            dense_optimizer=self.dense_optimizer, extra_state=self.extra_state,
        )
        self.tracker.reset(baseline=decision.kind == "baseline")
        self._force_baseline = ""
        # Until the outcome is known, assume failure: the interval's rows are gone from the tracker.
        self._state_if_failed = self._state.failed(decision)
        stall = (time.perf_counter() - t0) * 1e3
        staged.stall_ms = stall
        log.info("save %d at step %d: %s (%s), stall %.1f ms", decision.ckpt_id, step, decision.kind,
                 decision.reason, stall)
        handle = SaveHandle(step, decision, self._executor.submit(self._write, staged), stall)
        self._inflight = handle
        return handle

    def wait(self) -> CheckpointInfo | None:
        """Waits for the save in flight, if any. Raises SaveFailedError if it failed."""
        if self._inflight is None:
            return None
        handle = self._inflight
        self._settle(handle)
        return handle.wait()

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first, with their metadata."""
        return [CheckpointInfo.from_manifest(load_manifest(self._storage, i)) for i in committed_ids(self._storage)]

    def restore(self, step: int | None = None) -> int:
        """Restores the latest complete checkpoint (or the latest one of ``step``). Returns its step.

        Raises:
            CheckpointNotFoundError: nothing committed (or nothing at ``step``) under the root.
            CorruptCheckpointError: a file of the chain fails its checks (the message names it).
            IncompatibleCheckpointError: the checkpoint is of another model.
        """
        if self._inflight is not None:
            self._settle(self._inflight)
        chain = self._resolve(step) if self.rank == 0 else None
        target = self._agree(chain[-1]["id"] if chain else -1)
        if chain is None:
            if target < 0:
                raise CheckpointNotFoundError(self._not_found(step))
            chain = [load_manifest(self._storage, i) for i in load_manifest(self._storage, target)["chain"]]
        elif target < 0:
            raise CheckpointNotFoundError(self._not_found(step))
        restore_chain(
            chain, storage=self._storage, model=self.model, tracker=self.tracker, rank=self.rank,
            world_size=self.world_size, dense_optimizer=self.dense_optimizer, extra_state=self.extra_state,
        )
        m = chain[-1]
        self.tracker.reset(baseline=True)
        ids = existing_dir_ids(self._storage) if self.rank == 0 else []
        next_id = self._agree(max(ids + [m["id"]]) + 1)
        if self.config.policy == "consecutive":
            self._state = ChainState(next_id, tuple(m["chain"]), chain[0]["nbytes"],
                                     tuple(c["nbytes"] for c in chain[1:]))
        else:
            # The rows dirty between the baseline and this point are not in the tracker any more.
            self._state = ChainState(next_id)
            self._force_baseline = "after restore"
        if self._dist:
            dist.barrier()
        log.info("restored checkpoint %d (step %d, chain %s)", m["id"], m["step"], m["chain"])
        return int(m["step"])

    def close(self) -> None:
        """Waits for the save in flight and releases the background thread."""
        try:
            if self._inflight is not None:
                self._settle(self._inflight)
        finally:
            self._executor.shutdown(wait=True)
            if self._bg_storage is not None:
                self._bg_storage.close()
                self._bg_storage = None

    # ------------------------------------------------------------------ internals

    def _not_found(self, step: int | None) -> str:
        where = self.config.root
        if step is None:
            return f"no complete checkpoint under {where}; save one first, or check the root"
        return f"no complete checkpoint of step {step} under {where}; Checkpointer.list() shows what there is"

    def _resolve(self, step: int | None) -> list[dict[str, Any]] | None:
        """The chain of the newest committed checkpoint (of ``step``) whose chain is complete and sound."""
        ids = committed_ids(self._storage)
        for cid in reversed(ids):
            try:
                m = load_manifest(self._storage, cid)
            except CorruptCheckpointError:
                log.warning("checkpoint %d has a corrupt manifest; trying an older one", cid)
                continue
            if step is not None and m["step"] != step:
                continue
            try:
                return [load_manifest(self._storage, i) for i in m["chain"][:-1]] + [m]
            except (CheckpointNotFoundError, CorruptCheckpointError) as e:
                log.warning("checkpoint %d: its chain is incomplete (%s); trying an older one", cid, e)
        return None

    def _settle(self, handle: SaveHandle) -> None:
        """Waits for ``handle`` and folds its outcome into the chain state (once)."""
        try:
            info = handle.wait()
        except SaveFailedError as e:
            info = None
            log.warning("%s", e)
        with self._lock:
            if getattr(handle, "_settled", False):
                return
            handle._settled = True  # type: ignore[attr-defined]
            if info is None:
                self._state = self._state_if_failed
                self._force_baseline = f"previous save {handle.decision.ckpt_id} failed"
            else:
                self._state = self._state.committed(handle.decision, info.nbytes)

    def _make_store(self):
        if not self._dist:
            return None, 0
        store = dist.distributed_c10d._get_default_store()
        # Keys are namespaced per Checkpointer: a stale report of an earlier one must never be read.
        # os.urandom, not torch's RNG, which belongs to the training job.
        token = self._agree(int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0)
        return dist.PrefixStore(f"cnr/{token}", store), token

    def _collective_device(self) -> torch.device:
        if self._dist and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self._collective_device())
        dist.broadcast(t, src=0)
        return t.cpu()

    def _agree(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if not self._dist:
            return value
        return int(self._broadcast(torch.tensor([value], dtype=torch.int64)).item())

    def _gather_counts(self, busy: bool) -> tuple[dict[str, int], dict[str, int], dict[str, int]] | None:
        """All-gathers per-table dirty counts. None if any rank is still writing (skip this save)."""
        tables = self.tracker.tables()
        prev = self.tracker.dirty_counts()
        base = self.tracker.dirty_counts(since_baseline=True) if self.tracker.has_baseline_view else prev
        held = {t: sum(r1 - r0 for (r0, r1) in {rows for rows, _ in self.tracker.shard_ranges(t)}) for t in tables}
        row = [prev[t] for t in tables] + [base[t] for t in tables] + [held[t] for t in tables] + [int(busy)]
        local = torch.tensor(row, dtype=torch.int64)
        if self._dist:
            dev = self._collective_device()
            out = torch.empty(self.world_size * local.numel(), dtype=torch.int64, device=dev)
            dist.all_gather_into_tensor(out, local.to(dev))
            total = out.view(self.world_size, -1).cpu().sum(0)
        else:
            total = local
        if int(total[-1]) > 0:
            return None
        n = len(tables)
        split = [dict(zip(tables, total[i * n : (i + 1) * n].tolist())) for i in range(3)]
        return split[0], split[1], split[2]

    # ------------------------------------------------------------------ background

    def _write(self, staged: Staged) -> CheckpointInfo:
        d = staged.decision
        if self._bg_storage is None:
            self._bg_storage = Storage(self.config.root, self.config.storage_options)
        storage = self._bg_storage
        try:
            report = write_rank(staged, self.codec, storage, state_dtype=self._state_dtype)
        except Exception as e:  # reported to rank 0, which will not commit
            log.error("save %d: rank %d failed to write: %s: %s", d.ckpt_id, self.rank, type(e).__name__, e)
            report = {"rank": self.rank, "ok": False, "error": f"{type(e).__name__}: {e}"}
        if self.rank == 0:
            result = self._commit(d, report, storage)
        else:
            result = self._await_result(d, report)
        if not result["ok"]:
            self._cleanup(d, storage)
            raise SaveFailedError(
                f"save {d.ckpt_id} at step {d.step} did not commit: {result['error']}. "
                f"The previous checkpoint is intact; the next save writes a new baseline."
            )
        return CheckpointInfo.from_manifest(result["manifest"]) if "manifest" in result else self._info(d, result)

    def _info(self, d: Decision, result: dict[str, Any]) -> CheckpointInfo:
        return CheckpointInfo(
            id=d.ckpt_id, step=d.step, kind=d.kind, parent=d.parent, chain=d.chain, policy=self.config.policy,
            nbytes=result["nbytes"], rows_written=result["rows_written"], world_size=self.world_size,
            codec=result["codec"], stall_ms=result["stall_ms"], write_ms=result["write_ms"],
        )

    def _key(self, d: Decision, what: str) -> str:
        return f"{d.ckpt_id}/{what}"

    def _await_result(self, d: Decision, report: dict[str, Any]) -> dict[str, Any]:
        timeout = timedelta(seconds=self.config.save_timeout_s)
        try:
            self._store.set(self._key(d, f"report/{self.rank}"), json.dumps(report))
            self._store.wait([self._key(d, "result")], timeout)
            return json.loads(self._store.get(self._key(d, "result")))
        except Exception as e:
            return {"ok": False, "error": f"no word from rank 0 ({type(e).__name__}: {e})"}

    def _gather_reports(self, d: Decision, own: dict[str, Any]) -> list[dict[str, Any]]:
        reports = [own]
        if self.world_size == 1:
            return reports
        timeout = timedelta(seconds=self.config.save_timeout_s)
        keys = [self._key(d, f"report/{r}") for r in range(1, self.world_size)]
        try:
            self._store.wait(keys, timeout)
        except Exception as e:
            missing = [r for r, k in zip(range(1, self.world_size), keys) if not self._store.check([k])]
            return reports + [{"rank": r, "ok": False, "error": f"no report within {timeout} ({e})"} for r in missing]
        return reports + [json.loads(self._store.get(k)) for k in keys]

    def _commit(self, d: Decision, own: dict[str, Any], storage: Storage) -> dict[str, Any]:
        try:
            reports = self._gather_reports(d, own)
            bad = [f"rank {r['rank']}: {r['error']}" for r in reports if not r["ok"]]
            if bad:
                result = {"ok": False, "error": "; ".join(bad)}
            else:
                manifest = self._manifest(d, sorted(reports, key=lambda r: r["rank"]))
                storage.write_atomic(manifest_path(d.ckpt_id), seal(manifest))
                result = {"ok": True, "manifest": manifest}
        except Exception as e:
            result = {"ok": False, "error": f"rank 0 could not commit: {type(e).__name__}: {e}"}
        if self._dist:
            slim = {k: v for k, v in result.items() if k != "manifest"}
            if result["ok"]:
                info = CheckpointInfo.from_manifest(result["manifest"])
                slim.update(nbytes=info.nbytes, rows_written=info.rows_written, codec=info.codec,
                            stall_ms=info.stall_ms, write_ms=info.write_ms)
            self._store.set(self._key(d, "result"), json.dumps(slim))
        if result["ok"]:
            self._after_commit(storage)
        return result

    def _manifest(self, d: Decision, reports: list[dict[str, Any]]) -> dict[str, Any]:
        shapes: dict[str, list[int]] = {}
        for r in reports:
            shapes.update(r["table_shapes"])
        missing = sorted(set(self.tracker.tables()) - set(shapes))
        if missing:
            raise CheckpointError(f"no rank reported the shape of tables {missing}")
        return {
            **d.to_json(),
            "policy": self.config.policy,
            "world_size": self.world_size,
            "codec": {"method": self.config.quantization.method, "bits": self.config.quantization.bits,
                      "params": self.codec.params if hasattr(self.codec, "params") else {}},
            "tables": shapes,
            "table_fqns": self._table_fqns,
            "replicated": sorted({t for r in reports for t in r.get("replicated_tables", {})}),
            "nbytes": sum(r["nbytes"] for r in reports),
            "created_unix": time.time(),
            "ranks": reports,
        }

    def _after_commit(self, storage: Storage) -> None:
        """Rewrites the index and deletes checkpoints that no kept chain needs. Never fails the save."""
        try:
            ids = committed_ids(storage)
            manifests = {i: load_manifest(storage, i) for i in ids}
            baselines = [i for i in ids if manifests[i]["kind"] == "baseline"]
            keep_bases = set(baselines[-self.config.keep_last :])
            keep = {i for i, m in manifests.items() if m["chain"][0] in keep_bases}
            drop = [i for i in ids if i not in keep]
            write_index(storage, sorted(keep))
            for i in drop:
                m = manifests[i]
                storage.delete(manifest_path(i))  # uncommit first, then the payload
                storage.remove_dir(ckpt_dir(i), [r["file"] for r in m["ranks"]])
            newest = max(ids)
            for i in existing_dir_ids(storage):
                if i < newest and i not in manifests:  # a save that never committed
                    storage.remove_dir(ckpt_dir(i), [])
            if drop:
                log.info("garbage-collected checkpoints %s (keep_last=%d chains)", drop, self.config.keep_last)
        except Exception as e:
            log.warning("after commit: could not update the index or collect garbage: %s: %s", type(e).__name__, e)

    def _cleanup(self, d: Decision, storage: Storage) -> None:
        """Removes this rank's partial payload of a save that did not commit."""
        try:
            storage.delete(rank_file(d.ckpt_id, self.rank))
            if self.rank == 0:
                storage.remove_dir(ckpt_dir(d.ckpt_id), [])
        except Exception as e:
            log.warning("could not remove the partial files of save %d: %s", d.ckpt_id, e)
