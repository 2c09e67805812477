"""The collective part of a restore: rank 0 picks a sound chain, every rank applies it, all agree.

A rank that fails reports it instead of raising, so no rank waits in a collective; then every
rank raises the same error, or, under ``on_corrupt: fallback``, marks the culprit and tries the
newest older chain.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from cnr_torchrec.ckpt._collective import Failure, Ranks
from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.ckpt.format.bytes.chunks import IOPool
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import ckpt_id_of, load_manifest
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.placement import reports_for
from cnr_torchrec.ckpt.host_memory import host_uses, short_of_memory
from cnr_torchrec.ckpt.job_state import JobState
from cnr_torchrec.ckpt.layout import shard_boxes
from cnr_torchrec.ckpt.memory.tier import Candidate, MemoryTier
from cnr_torchrec.ckpt.restore.chain import RestoreOptions, restore_chain
from cnr_torchrec.ckpt.restore.compat import check_model
from cnr_torchrec.ckpt.restore.host_copies import Key, fits, stageable_weights
from cnr_torchrec.ckpt.restore.relocate import needs_relocation
from cnr_torchrec.ckpt.restore.resolve import Pick, resolve_chain
from cnr_torchrec.ckpt.restore.rollback import Snapshot
from cnr_torchrec.ckpt.restore.stats import timed
from cnr_torchrec.ckpt.restore.threads import decode_threads
from cnr_torchrec.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    RestoreFailedError,
)
from cnr_torchrec.track.tbe_cache import flush_caches

__all__ = ["Restorer"]

log = logging.getLogger(__name__)


class Restorer:
    """Restores of ``job`` for one :class:`~cnr_torchrec.ckpt.Checkpointer`: its storage, I/O threads, ranks and
    memory tier."""

    def __init__(self, config: CheckpointConfig, job: JobState, *, storage: Storage, io: IOPool, ranks: Ranks,
                 memory: MemoryTier | None = None) -> None:
        self.config, self._storage, self._io, self._ranks = config, storage, io, ranks
        self._memory = memory
        self.sources: list[tuple[int, str, str]] = []  # the last restore's (rank, "memory" | "storage", why)
        self.job = job
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.stats: dict[str, float] = {}  # the last restore's phases on this rank (restore/stats.py)
        self._snapshot: Snapshot | None = None  # what the restore in progress may overwrite (restore_rollback)
        self._source: tuple[str, str] = ("storage", "")  # where this rank's last attempt took its shards, and why

    def run(self, step: int | None, per_rank_state: str, buffers: Mapping[Key, torch.Tensor] | None = None
            ) -> tuple[list[Manifest], dict[int, str], dict[Any, Any]]:
        """Picks, applies and agrees on a chain (collective). Returns it, the checkpoints skipped as unsound
        (id -> why), the same on every rank, and the shards it staged (float32 host rows by ``(table, rows,
        cols)``, equal to the weights now: what a residual reconstruction starts from). Raises what
        :meth:`Checkpointer.restore` documents; when it raises, the model is as it was (``restore_rollback``).

        Args:
            buffers: float32 host tensors by shard key that the restore may stage into and overwrite (a
                residual reconstruction's rows); other shards are staged into new host memory, where every host
                has it (else their weights are written in place, with a warning, and cannot be rolled back).
        """
        self.stats = {}
        self.sources = []
        self._snapshot = None
        try:
            return self._run(step, per_rank_state, buffers or {})
        except BaseException:
            if self._snapshot is not None:
                with timed(self.stats, "rollback_ms"):
                    self._snapshot.put_back()
                log.warning("restore failed: the model, its optimizers and its state are put back as they were "
                            "before restore()")
            # Tables built without their initial values (will_restore) get them now, as if built eagerly.
            self.job.materialize_init()
            raise
        finally:
            self._snapshot = None  # its host copy is freed here

    def _run(self, step: int | None, per_rank_state: str, buffers: Mapping[Key, torch.Tensor]
             ) -> tuple[list[Manifest], dict[int, str], dict[Any, Any]]:
        model_tables = self._model_tables()
        if self.config.restore_rollback:
            # fused_uvm_caching: the cache's rows are the newest; written back once, before any weight is read
            # (sized here, copied by the rollback's snapshot), never after.
            flush_caches(self.job.tracker.tbes())
        stage = self.config.restore_rollback and self._room_to_stage(buffers)
        bad: dict[int, str] = {}  # checkpoint id -> why it cannot be restored (names the file); same on every rank
        while True:
            with timed(self.stats, "resolve_ms"):
                pick, chain = self.agree_on_pick(step, bad, local=True)
            for i, why in pick.skipped:
                if self.rank != 0:  # rank 0 logged them as it found them; every rank's log should say
                    log.warning("restore: skipping checkpoint %d: %s (on_corrupt: fallback)", i, why)
                bad[i] = why
            if not pick.chain:
                if bad:
                    raise self._none_restores(step, bad)
                raise CheckpointNotFoundError(self.not_found(step))
            ids = list(pick.chain)
            status, own, chain, staged = self._attempt(ids, chain, model_tables, per_rank_state, stage, buffers)
            with timed(self.stats, "agree_ms"):
                failed = self._ranks.failures(status)
            if not failed:
                break
            self._after_failed_attempt(failed, own, ids, bad)  # a staged attempt's rows never reached the model
        assert chain is not None  # an attempt every rank succeeded in loaded its manifests
        with timed(self.stats, "commit_ms"):
            self._commit(staged, ids[-1])  # every rank succeeded: the staged or checked rows go into the model
        self.job.init_overwritten()  # every row of the tables was restored (will_restore's values never drawn)
        self._hear_sources(chain[-1].id)
        return chain, bad, staged.by_key()

    def _commit(self, staged: Any, ckpt_id: int) -> None:
        """Writes the rows every rank has read and checked (collective): a plain chain's are decoded into the
        weights in place now, a residual chain's copied from its host copies. Nothing the files hold can fail
        here any more (the attempt checked it); should something else (memory), every rank hears of it.

        Raises:
            RestoreFailedError: some rank could not write its rows (on every rank).
        """
        own: Exception | None = None
        try:
            staged.commit()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, and raise alike
            own = e
        failed = self._ranks.failures(None if own is None else Failure.of(own, self.rank, "writing the rows"))
        if failed:
            f = failed[0]
            raise RestoreFailedError(
                f"rank {f.rank} could not write the rows of checkpoint {ckpt_id} it had read and checked "
                f"({f.cause}: {f.message}); its embedding weights are partly overwritten (the other ranks' hold "
                "the checkpoint's), and every optimizer, dense and per-rank state is put back. Free memory and "
                "restore again before training") from own
        if self._snapshot is not None:
            self.stats["snapshot_bytes"] = float(self._snapshot.nbytes)

    def _hear_sources(self, ckpt_id: int) -> None:
        """Every rank hears where each rank's shards came from (collective), and rank 0 logs it."""
        source, why = self._source
        self.sources = [(int(r), str(src), str(w)) for r, src, w in self._ranks.exchange([self.rank, source, why])]
        from_memory = [r for r, src, _ in self.sources if src == "memory"]
        self.stats["from_memory"] = float(source == "memory")
        self.stats["memory_ranks"] = float(len(from_memory))
        if self.rank == 0 and (from_memory or self._memory is not None and self._memory.active):
            others = "; ".join(f"rank {r}: {why}" for r, src, why in self.sources if src != "memory")
            log.info("restore of checkpoint %d: ranks %s took their shards from memory images, %d read storage%s",
                     ckpt_id, from_memory, len(self.sources) - len(from_memory), f" ({others})" if others else "")

    def _none_restores(self, step: int | None, bad: dict[int, str]) -> RestoreFailedError:
        """The error for a root whose checkpoints (of ``step``) exist but none of which restores."""
        skipped = "; ".join(f"checkpoint {i}: {why}" for i, why in sorted(bad.items()))
        which = "" if step is None else f" of step {step}"
        state = ("the model is as it was before restore()" if self.config.restore_rollback else
                 "the tables may be partly overwritten (restore_rollback: false): restore another checkpoint "
                 "before training")
        return RestoreFailedError(
            f"checkpoints{which} exist under {self.config.root}, but none could be restored ({skipped}); {state}. "
            f"Run `cnr verify {self.config.root}` to see which files are bad, then restore(step=...) an older "
            "checkpoint, or move the root aside to start afresh. This is not CheckpointNotFoundError: do not "
            "treat it as a fresh start", skipped=bad)

    def _room_to_stage(self, buffers: Mapping[Key, torch.Tensor]) -> bool:
        """Whether every host has the memory to stage its ranks' shards that ``buffers`` do not hold. Collective.
        Where one does not, every rank warns and writes its weights in place (``restore_rollback`` then puts back
        everything but them)."""
        with timed(self.stats, "snapshot_ms"):
            needed = sum(w.numel() * w.element_size() for key, w in stageable_weights(self.job.tracker)
                         if not fits(buffers.get(key), w))
            _, hosts = host_uses(needed, distributed=self._ranks.distributed)
        short = short_of_memory(hosts)
        if short is None:
            return True
        log.warning("restore_rollback steps aside for the embedding weights: staging them needs %.2f GB on host %s "
                    "(%d rank(s)), which has %.2f GB available, so they are written in place, and a restore that "
                    "fails now leaves them partly overwritten (restore again before training then). Everything "
                    "else is still put back on a failure", short.needed / 1e9, short.host, short.ranks,
                    (short.available or 0) / 1e9)  # known: a host whose memory is unknown is never short
        return False

    def _attempt(self, ids: list[int], chain: list[Manifest] | None, model_tables: dict[str, list[int]],
                 per_rank_state: str, stage: bool, buffers: Mapping[Key, torch.Tensor]
                 ) -> tuple[Failure | None, Exception | None, list[Manifest] | None, Any]:
        """Applies the chain ``ids`` on this rank. Returns (failure for the other ranks, own exception, chain,
        the staged weights to commit once every rank succeeded)."""
        try:
            if chain is None:
                with timed(self.stats, "manifests_ms"):
                    chain = [load_manifest(self._storage, i) for i in ids]
            with timed(self.stats, "check_ms"):
                check_model(chain[-1], model_tables, self.job.model, self.job.tracker)
            written_by = chain[-1].world_size
            if written_by != self.world_size and self.job.extra_state and per_rank_state == "strict":
                raise IncompatibleCheckpointError(
                    f"checkpoint {ids[-1]} was written by {written_by} ranks and is restored onto "
                    f"{self.world_size}: per-rank state {sorted(self.job.extra_state)} cannot be mapped onto other "
                    "ranks. Restore onto the same world size, or call restore(per_rank_state='drop') to restore "
                    "the model and optimizers and start that state afresh."
                )
            extra_state = self.job.extra_state
            if not chain[-1].per_rank_state and extra_state and per_rank_state == "strict":
                raise IncompatibleCheckpointError(
                    f"checkpoint {ids[-1]} holds no per-rank state (its index says per_rank_state: false: an import, "
                    f"or a compaction by another number of ranks), so extra_state {sorted(extra_state)} cannot "
                    "be restored from it. Call restore(per_rank_state='drop') to restore the model and optimizers "
                    "and start that state afresh."
                )
            if self.job.deferred_init is not None and needs_relocation(chain, self.job.tracker, self.rank,
                                                                       self.world_size):
                self.job.materialize_init()  # relocated slots the checkpoint does not name keep their values
            if self._snapshot is None and self.config.restore_rollback:  # nothing is written before this
                with timed(self.stats, "snapshot_ms"):
                    self._snapshot = Snapshot.take(model=self.job.model, tracker=self.job.tracker,
                                                   dense_optimizer=self.job.dense_optimizer,
                                                   extra_state=self.job.extra_state, rng=self.config.restore_rng,
                                                   deferred=self.job.deferred_init)
            image = self._image_for(chain)
            options = RestoreOptions(rng=self.config.restore_rng, stage=stage, pool=self._io,
                                     threads=decode_threads(self.config.restore_threads), stats=self.stats)
            staged = restore_chain(  # every chunk is checked against its xxh3 as it lands
                chain, self.job, storage=self._storage, rank=self.rank, world_size=self.world_size,
                options=options, buffers=buffers, image=image,
            )
            if image is not None and not image.checked:  # its bytes failed their check as they were copied
                self._source = ("storage", image.why)
        except Exception as e:  # another rank must hear of it, or it waits in the exchange after this
            # A CheckpointNotFoundError here is a file that vanished since the pick: corrupt, like a bad one.
            return Failure.of(e, self.rank, f"restoring checkpoint {ids[-1]}"), e, chain, None
        return None, None, chain, staged

    def _image_for(self, chain: list[Manifest]) -> Candidate | None:
        """This rank's memory image if it is sealed for ``chain`` on this layout (:meth:`MemoryTier.candidate`,
        which unseals an image it does not give: the staged restore may write into its rows), else None. Its
        bytes are checked here, unless the model's weights still wait for their initial values: then they are
        checked as they are copied in (:mod:`.from_memory`)."""
        if self._memory is None:
            self._source = ("storage", "no memory tier (quantization.residual off, or memory_tier: off)")
            return None
        with timed(self.stats, "memory_check_ms"):
            image, why = self._memory.candidate(chain, check=self.job.deferred_init is None)
        self._source = ("memory" if image is not None else "storage", why)
        return image

    def _after_failed_attempt(self, failed: list[Failure], own: Exception | None, ids: list[int],
                              bad: dict[int, str]) -> None:
        """Raises what every rank raises alike, or marks the culprit in ``bad`` for a fallback (``on_corrupt``)."""
        errors_seen = [f for f in failed if not f.file_problem]
        if errors_seen:  # the same error on every rank; the rank it happened on chains its own
            raise errors_seen[0].error() from (own if errors_seen[0].rank == self.rank else None)
        f = failed[0]
        if self.config.on_corrupt == "fail":
            state = ("The model is as it was before restore()." if self.config.restore_rollback else
                     "The model is partly overwritten (restore_rollback: false): restore again before training.")
            raise CorruptCheckpointError(
                f"{f.message} (rank {f.rank}, restoring checkpoint {ids[-1]}; on_corrupt: fail). Restore another "
                f"checkpoint with restore(step=...), or set on_corrupt: fallback to take the newest sound one. {state}",
                path=f.path,
            ) from (own if f.rank == self.rank else None)
        owner = ckpt_id_of(f.path)
        culprit = owner if owner in ids else ids[-1]
        bad[culprit] = f"{f.path or 'a file'} failed its checks on rank {f.rank}: {f.message}"
        log.warning("restore: checkpoint %d cannot be restored: %s (rank %d: %s); falling back to an older "
                    "checkpoint (on_corrupt: fallback)", ids[-1], f.path or "a file", f.rank, f.message)

    def _model_tables(self) -> dict[str, list[int]]:
        """The whole model's table shapes (collective): a rank knows only the tables it holds shards of, and
        every rank must refuse another model's checkpoint before it changes anything."""
        model_tables: dict[str, list[int]] = {t: [] for t in self.job.tracker.tables()}
        for part in self._ranks.exchange({t: list(shape) for t in model_tables
                                          if (shape := self.job.tracker.table_shape(t)) is not None}):
            model_tables.update(part)
        return model_tables

    def not_found(self, step: int | None) -> str:
        where = self.config.root
        if step is None:
            return f"no complete checkpoint under {where}; save one first, or check the root"
        return f"no complete checkpoint of step {step} under {where}; Checkpointer.list() shows what there is"

    def _resolve(
        self, step: int | None, bad: dict[int, str], quiet: bool = False
    ) -> tuple[Pick, list[Manifest] | None]:
        """This rank's pick for a restore (see :func:`cnr_torchrec.ckpt.restore.resolve.resolve_chain`)."""
        boxes = shard_boxes(self.job.tracker)
        data_parallel = any(self.job.tracker.is_data_parallel(t) for t in self.job.tracker.tables())
        return resolve_chain(self._storage, step, bad, fail=self.config.on_corrupt == "fail", quiet=quiet,
                             stats=self.stats, reads=lambda m: reports_for(m, self.rank, boxes, data_parallel))

    def agree_on_pick(
        self, step: int | None, bad: dict[int, str], *, local: bool
    ) -> tuple[Pick, list[Manifest] | None]:
        """Rank 0's pick for a restore, on every rank, and the pick's manifests where this rank has them.

        Collective. Rank 0 resolves (and adds what it finds unsound to ``bad``); if it
        raises, every rank raises the same named error (StorageError for a listing or read
        that failed). With ``local``, the other ranks resolve too, at the same time, without
        touching ``bad``: only a speed-up, so that a rank whose pick matches rank 0's keeps
        the manifests it has loaded; its own failures are rank 0's to report.
        """
        mine: Pick | None = None
        chain: list[Manifest] | None = None
        if local and self.rank != 0:
            try:
                mine, chain = self._resolve(step, dict(bad), quiet=True)
            except Exception:  # noqa: BLE001 - rank 0's pick decides, and rank 0 reports its own failures
                mine, chain = None, None

        def resolve_on_rank0() -> dict[str, Any]:
            nonlocal mine, chain
            mine, chain = self._resolve(step, bad)
            return mine.to_json()  # it reaches the other ranks as JSON

        pick = Pick.from_json(self._ranks.from_rank0(resolve_on_rank0, what="choosing the checkpoint to restore"))
        if mine is None or mine.chain != pick.chain:
            chain = None
        return pick, chain
