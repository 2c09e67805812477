"""The commit protocol of a save, run on the Checkpointer's background thread.

:meth:`Committer.write` reads as the protocol goes: this rank writes its payload file and its part
(format/parts.py); the ranks run the commit round (:mod:`~cnr_torchrec.ckpt.commit_round`: each tells
rank 0 through the c10d store, never the training process group, that its part is durable, and hears
the outcome); rank 0's decision in that round is :meth:`Committer._commit` (the index built from the
parts, checked, sealed and written atomically: the commit); then rank 0 rewrites index.json and collects
what the kept chains no longer need, and every rank takes the committed rows into its reconstruction and
memory image. A save that does not commit leaves nothing that looks committed and removes its partial
files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cnr_torchrec.ckpt import fault_injection
from cnr_torchrec.ckpt.commit_round import Outcome, Peers, Report
from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.ckpt.format import writing
from cnr_torchrec.ckpt.format.bytes.chunks import IOPool
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import manifest_path, remove_partial, seal
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.parts import with_parts, write_part
from cnr_torchrec.ckpt.format.schema import check_manifest
from cnr_torchrec.ckpt.format.writing import JobFields
from cnr_torchrec.ckpt.job_state import JobState
from cnr_torchrec.ckpt.layout import shard_boxes
from cnr_torchrec.ckpt.memory.tier import MemoryTier, payload_identity
from cnr_torchrec.ckpt.save.planner import Decision
from cnr_torchrec.ckpt.save.residual import Reconstruction
from cnr_torchrec.ckpt.save.staging import Staged, StagingBuffers
from cnr_torchrec.ckpt.save.writer import write_rank
from cnr_torchrec.errors import CheckpointError, SaveFailedError
from cnr_torchrec.quant import Codec

__all__ = ["CheckpointInfo", "Committer", "manifest_body"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it."""

    id: int
    step: int
    kind: str
    parent: int | None
    chain: tuple[int, ...]
    policy: str | None
    nbytes: int
    rows_written: int
    world_size: int
    codec: Mapping[str, Any]
    stall_ms: float
    write_ms: float

    @classmethod
    def from_manifest(cls, m: Manifest, chain: tuple[int, ...]) -> CheckpointInfo:
        """The info of manifest ``m``, whose chain (ids, baseline first) is ``chain``."""
        return cls(
            id=m.id, step=m.step, kind=m.kind, parent=m.parent, chain=tuple(chain), policy=m.policy,
            nbytes=m.nbytes, rows_written=m.rows_written, world_size=m.world_size, codec=m.codec,
            stall_ms=m.stall_ms, write_ms=m.write_ms,
        )



def manifest_body(d: Decision, parts: list[dict[str, Any]], job: JobFields, tables: list[str],
                  per_rank_state: bool | None = None) -> dict[str, Any]:
    """The index of save ``d`` from its ranks' parts (what :func:`write_part` returned, ordered by rank) and the
    ``job``'s fields. ``tables``: every table of the model, whose shapes the parts give.

    Raises:
        CheckpointError: no rank gives the shape of some table.
    """
    shapes: dict[str, list[int]] = {}
    for p in parts:
        shapes.update(p["table_shapes"])
    missing = sorted(set(tables) - set(shapes))
    if missing:
        raise CheckpointError(f"no rank reported the shape of tables {missing}")
    return writing.manifest_body(d.links(), job, tables=shapes, parts=parts, per_rank_state=per_rank_state)


class Committer:
    """The background half of a :class:`~cnr_torchrec.ckpt.Checkpointer`'s saves: write, report, commit.

    Args:
        config: the Checkpointer's config (root, storage options, chunking, timeouts, policy).
        job: the job's state: its tracker gives every table of the model (a manifest must give each one's
            shape) and the shards this rank holds (:func:`~cnr_torchrec.ckpt.layout.shard_boxes`, which each
            index records).
        peers: the ranks each save's commit round runs among (this one, how many, the c10d store, the timeout).
        io: the threads that write chunks.
        staging: where staged buffers go back once written.
        on_commit: rank 0 calls it with each committed body and its storage (retention).
        reconstruction: what the committed chain restores on this rank (residual coding, or the memory tier).
        memory: this rank's memory image, sealed for each checkpoint once the reconstruction has taken it.
    """

    def __init__(self, config: CheckpointConfig, job: JobState, *, peers: Peers, io: IOPool, staging: StagingBuffers,
                 on_commit: Callable[[Manifest, Storage], None], reconstruction: Reconstruction | None = None,
                 memory: MemoryTier | None = None) -> None:
        self.config, self.rank, self.world_size = config, peers.rank, peers.world_size
        self._peers = peers
        self._boxes = shard_boxes(job.tracker)  # the plan's layout: fixed while the job runs
        tables = list(job.tracker.tables())
        self.reconstruction = reconstruction
        self.memory = memory
        self._io, self._staging = io, staging
        self._tables, self._on_commit = tables, on_commit
        self._state_dtype = getattr(torch, config.quantization.state_dtype)
        self._storage: Storage | None = None  # the save thread's own (Storage is not thread-safe)

    def close(self) -> None:
        if self._storage is not None:
            self._storage.close()
            self._storage = None

    def write(self, d: Decision, staged: Staged | None, stage_error: str, codec: Codec,
              fields: JobFields) -> CheckpointInfo:
        """Writes this rank's payload (``staged``; None if staging failed with ``stage_error``) and commits.

        ``codec`` encodes the rows; ``fields`` are the manifest's job-level fields (policy, world
        size, codec description, restores, table FQNs), as they were when the save was taken.

        Every rank reaches rank 0's verdict, whatever failed where: a rank that could not
        stage, open its storage or write reports the failure instead of raising, and rank 0
        publishes the outcome of its commit (a failed manifest write included). Each rank
        then raises the same SaveFailedError, naming the rank and the cause.
        """
        storage: Storage | None = None
        if staged is None:
            report = writing.failed_report(self.rank, stage_error)
        else:
            try:
                storage = self._background_storage()
                report = write_rank(staged, codec, storage, state_dtype=self._state_dtype,
                                    chunk_bytes=self.config.chunk_bytes, pool=self._io,
                                    reconstruction=self.reconstruction,
                                    residual=bool(self.config.quantization.residual))
                # A report the schema refuses is never written.
                part = write_part(storage, d.ckpt_id, report, self._boxes)
                fault_injection.hit("write.after")
            except Exception as e:  # reported to rank 0, which will not commit
                log.error("save %d: rank %d failed to write: %s: %s", d.ckpt_id, self.rank, type(e).__name__, e)
                report = part = writing.failed_report(self.rank, f"{type(e).__name__}: {e}")
            finally:
                self._staging.give_back(staged.buffers)  # written (or given up): the next save may reuse them
        if staged is None:
            part = report
        round_ = self._peers.round(str(d.ckpt_id))
        out = round_.run(Report.of_part(part), lambda reports: self._commit(d, reports, storage, fields))
        if out.ok and out.manifest is not None:  # rank 0, which committed
            assert storage is not None  # a save that committed wrote through it
            fault_injection.hit("gc.before")
            self._on_commit(out.manifest, storage)
        if self.reconstruction is not None:
            if out.ok:
                self._commit_reconstruction(d, report)
            else:
                self.reconstruction.discard()
        if not out.ok and out.heard:  # rank 0's verdict, or rank 0 itself: nothing committed
            self._cleanup(d, storage)
            raise SaveFailedError(
                f"save {d.ckpt_id} at step {d.step} did not commit: {out.error}. "
                f"The previous checkpoint is intact; the next save writes a new baseline."
            )
        if not out.ok:  # no verdict: rank 0 may have committed before it died, so this rank's files stay
            raise SaveFailedError(
                f"save {d.ckpt_id} at step {d.step}: {out.error}. Rank 0 may have committed it before it "
                "failed, so this rank keeps its files (rank 0 removes them at its next commit if it did not); the "
                "previous checkpoint is intact either way, and the next save writes a new baseline."
            )
        if out.manifest is not None:
            return CheckpointInfo.from_manifest(out.manifest, d.chain)
        return self._info(d, out.facts)

    def _commit_reconstruction(self, d: Decision, report: dict[str, Any]) -> None:
        """The committed save's rows into the reconstruction; with a memory image, between its unseal and its
        seal for this checkpoint (a process stopped in between leaves it unsealed, never torn)."""
        assert self.reconstruction is not None  # called only for a job that keeps one
        memory = self.memory if self.memory is not None and self.memory.active else None
        if memory is None:
            self.reconstruction.commit()
            return
        with memory.update() as image:
            fault_injection.hit("image.unsealed")
            self.reconstruction.commit()
            fault_injection.hit("image.updated")
            image.seal(d.ckpt_id, d.chain, payload_identity(report))

    def _background_storage(self) -> Storage:
        """The save thread's own Storage, opened on first use."""
        if self._storage is None:
            self._storage = self._io.open_storage()
        return self._storage

    def _info(self, d: Decision, result: Mapping[str, Any]) -> CheckpointInfo:
        return CheckpointInfo(
            id=d.ckpt_id, step=d.step, kind=d.kind, parent=d.parent, chain=d.chain, policy=self.config.policy,
            nbytes=result["nbytes"], rows_written=result["rows_written"], world_size=self.world_size,
            codec=result["codec"], stall_ms=result["stall_ms"], write_ms=result["write_ms"],
        )

    def _commit(self, d: Decision, reports: list[Report], storage: Storage | None, fields: JobFields) -> Outcome:
        """Rank 0's decision in the round: the manifest written if every rank's part is, and what the other
        ranks are told of it. ``storage`` is None only when rank 0's own part failed."""
        bad = [f"rank {r.rank}: {r.error}" for r in reports if not r.ok]
        if bad:
            return Outcome(False, "; ".join(bad))
        assert storage is not None  # rank 0's own report is good, so it opened its storage
        body = manifest_body(d, sorted((dict(r.part) for r in reports), key=lambda p: p["rank"]), fields, self._tables)
        # An index the schema refuses never commits (each part was checked by its rank as it wrote it).
        manifest = with_parts(check_manifest(body, manifest_path(d.ckpt_id)), storage)
        fault_injection.hit("commit.before_manifest")
        storage.write_atomic(manifest_path(d.ckpt_id), seal(body, key=storage.key))
        fault_injection.hit("commit.after_manifest")
        info = CheckpointInfo.from_manifest(manifest, d.chain)
        return Outcome(True, facts={"nbytes": info.nbytes, "rows_written": info.rows_written,
                                    "codec": dict(info.codec), "stall_ms": info.stall_ms, "write_ms": info.write_ms},
                       manifest=manifest)

    def _cleanup(self, d: Decision, storage: Storage | None) -> None:
        """Removes this rank's partial payload of a save that did not commit (rank 0: its directory too). Called
        on rank 0, and on a rank that heard rank 0's verdict; a rank that did not hear it deletes nothing (only
        the coordinator deletes files whose fate is unknown: ``remove_uncommitted`` at its next commit).

        Rank 0 deletes the manifest first, in case it was written but the other ranks could
        not be told: a checkpoint they count as failed must not stay committed.
        """
        try:
            remove_partial(storage or self._background_storage(), d.ckpt_id, self.rank)
        except Exception as e:
            log.warning("could not remove the partial files of save %d: %s", d.ckpt_id, e)
