"""The Checkpointer: decoupled, differential, quantized saves of a CheckNRunDMP, and restore."""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from cnr_torchrec import _exit
from cnr_torchrec._logging import install_default_handler
from cnr_torchrec.ckpt._collective import Failure, Ranks, as_named_error
from cnr_torchrec.ckpt.commit_round import Peers
from cnr_torchrec.ckpt.compact.background import Compaction, Compactor
from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.ckpt.config_resolve import resolve
from cnr_torchrec.ckpt.failure_rates import IntervalPlan, IntervalTimer, bits_for_job, plan_interval
from cnr_torchrec.ckpt.format.bytes.chunks import IOPool
from cnr_torchrec.ckpt.format.bytes.integrity import RootKey, load_key
from cnr_torchrec.ckpt.format.bytes.roots import normal_root
from cnr_torchrec.ckpt.format.commits import chain_ids, committed_ids, existing_dir_ids, load_manifest
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.origin import write_origin
from cnr_torchrec.ckpt.format.writing import JobFields, codec_description
from cnr_torchrec.ckpt.job_state import DenseOptimizer, JobState, Stateful
from cnr_torchrec.ckpt.live.dense_optim import check_dense_optimizer
from cnr_torchrec.ckpt.memory.tier import MemoryTier, payload_identity
from cnr_torchrec.ckpt.restore.partial import Recovery, RecoveryInfo
from cnr_torchrec.ckpt.restore.restorer import Restorer
from cnr_torchrec.ckpt.restore.stats import timed
from cnr_torchrec.ckpt.retention import Retention
from cnr_torchrec.ckpt.save.chain_book import ChainBook
from cnr_torchrec.ckpt.save.commit import CheckpointInfo, Committer
from cnr_torchrec.ckpt.save.planner import Decision, decide
from cnr_torchrec.ckpt.save.residual import Reconstruction
from cnr_torchrec.ckpt.save.staging import Staged, StagingBuffers, stage
from cnr_torchrec.ckpt.save.vote import SaveVote
from cnr_torchrec.errors import CheckpointerClosedError, CnrError, ConfigError, SaveFailedError
from cnr_torchrec.quant import Codec, get_codec
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["Checkpointer", "CheckpointInfo", "RecoveryInfo", "SaveHandle"]

log = logging.getLogger(__name__)


def _table_fqns(model: torch.nn.Module, tracker: DirtyRowTracker) -> dict[str, str]:
    """Each table's weight name in the unsharded model ("ebc.embedding_bags.t0.weight"), for exports."""
    out = {}
    names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
    for table in tracker.tables():
        module = tracker.table_module(table)
        hits = [n for n in names if n.startswith(module + ".") and n.endswith(f".{table}.weight")]
        out[table] = hits[0] if len(hits) == 1 else f"{module}.{table}.weight"
    return out


def _check_arguments(model: torch.nn.Module, config: CheckpointConfig, dense_optimizer: DenseOptimizer | None,
                     extra_state: Mapping[str, Stateful] | None) -> JobState:
    """The job's state, built once the Checkpointer's arguments are found usable.

    Raises:
        ConfigError: the model is no CheckNRunDMP, the config no CheckpointConfig, an extra_state
            object is not Stateful, or a dense parameter has no name.
    """
    tracker = getattr(model, "dirty_tracker", None)
    if tracker is None:
        raise ConfigError("Checkpointer needs a CheckNRunDMP (a model with a dirty_tracker); wrap the model in it")
    if not isinstance(config, CheckpointConfig):
        raise ConfigError(f"config must be a CheckpointConfig (see cnr_torchrec.load_config), got {type(config)}")
    for name, obj in (extra_state or {}).items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(f"extra_state[{name!r}] has no state_dict()/load_state_dict(); pass a Stateful object")
    if dense_optimizer is not None:
        check_dense_optimizer(model, dense_optimizer)  # refused now, not at the first save or restore
    return JobState(model, tracker, dense_optimizer, dict(extra_state or {}))


def _enable_views(tracker: DirtyRowTracker, config: CheckpointConfig) -> None:
    """Turns on what the config needs of the tracker: the "since baseline" view, the row counters.

    Raises:
        ConfigError: compaction with a row budget, or a row budget under another policy than consecutive.
    """
    if config.policy in ("one_shot", "intermittent") or config.compaction is not None:
        tracker.enable_baseline_view()  # compaction: the rows dirty since its tip
    if config.compaction is not None and config.budget.max_rows_fraction is not None:
        raise ConfigError(
            "compaction and budget.max_rows_fraction do not go together yet: the delta that hangs on a compacted "
            "baseline must hold every row dirty since the compaction's tip. Leave one of them out"
        )
    if config.budget.max_rows_fraction is not None:
        if config.policy != "consecutive":
            raise ConfigError(
                f"budget.max_rows_fraction needs policy consecutive, not {config.policy!r}: only a consecutive "
                "chain keeps the rows a budget left out (one-shot deltas restore from the baseline and the latest "
                "delta alone; baselines are never limited). Set policy: consecutive, or "
                "budget.max_rows_fraction: null"
            )
        tracker.enable_counting(config.budget.priority, config.budget.ssu_rate)


class SaveHandle:
    """A save in flight. ``wait()`` returns once it is committed (or raises SaveFailedError).

    Attributes:
        step: the training step the save was called at.
        decision: what the ranks decided to write (None for a save ``on_busy: skip`` dropped).
        stall_ms: how long ``save()`` held the training thread.
    """

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


def _agree_on_key(config: CheckpointConfig, ranks: Ranks) -> RootKey | None:
    """The root's key (``config.integrity``), loaded on every rank; every rank must hold the same one (compared by
    fingerprint), or none.

    Raises:
        ConfigError: on every rank, where one rank could not load its key or the ranks' keys differ.
    """
    key, failure = None, None
    try:
        key = load_key(config.integrity.key_file, config.integrity.key_env)
    except ConfigError as e:
        failure = Failure.of(e, ranks.rank, "loading the root's key (integrity)")
    ranks.raise_any(failure)
    prints = ranks.exchange(None if key is None else key.fingerprint)
    if len(set(prints)) > 1:
        held = ", ".join(f"{r}: {p or 'no key'}" for r, p in enumerate(prints))
        raise ConfigError(f"integrity: the ranks hold different keys (fingerprints by rank: {held}); give every rank "
                          "the same key")
    return key


class Checkpointer:
    """Differential, quantized checkpoints of a :class:`~cnr_torchrec.CheckNRunDMP`.

    Every rank constructs one, with the same config, and calls ``save``/``restore`` at
    the same points. A save blocks training only for the all-gather of dirty counts and
    the copy of the dirty rows to host; encoding and writing run on a background thread
    that coordinates with the other ranks through the c10d store, never the training
    process group.

    Args:
        model: the sharded model; its ``dirty_tracker`` says which rows changed.
        config: see :class:`~cnr_torchrec.ckpt.CheckpointConfig`; left as it is given.
        dense_optimizer: the optimizer of the dense (DDP) parameters, saved in full.
        extra_state: per-rank stateful objects (the data loader...), saved and restored by name.

    Attributes:
        config: the config it runs with: ``config`` with the defaults that depend on the job settled
            (:func:`~cnr_torchrec.ckpt.config_resolve.resolve`), the same on every rank.
        job: the :class:`~cnr_torchrec.ckpt.job_state.JobState` it saves and restores (the model, its tracker,
            ``dense_optimizer``, ``extra_state``), built once here and passed whole to the save, the restore
            and the compaction.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: CheckpointConfig,
        *,
        dense_optimizer: DenseOptimizer | None = None,
        extra_state: Mapping[str, Stateful] | None = None,
    ) -> None:
        install_default_handler()  # the library's INFO lines reach stderr unless the application configured logging
        job = _check_arguments(model, config, dense_optimizer, extra_state)
        tracker = job.tracker
        self._ranks = Ranks()
        self._dist = self._ranks.distributed
        self.rank = self._ranks.rank
        self.world_size = self._ranks.world_size
        # Before anything is opened: a refusal leaves nothing behind. The caller's config stays as it was given.
        config = resolve(config, tracker, self._ranks)
        self.job = job  # built once, passed whole to the save, the restore and the compaction
        self.config = config
        self._restores = 0  # restores this job has performed, carried from manifest to manifest
        self.codec = self._pick_codec()
        self._table_fqns = _table_fqns(model, tracker)
        _enable_views(tracker, config)

        key = _agree_on_key(config, self._ranks)  # None: a root without a key
        self._io = IOPool(config.root, config.storage_options, config.io_threads, key)  # chunk reads and writes
        self._storage = self._io.open_storage()
        self._staging = StagingBuffers()  # host memory each save copies into, reused from save to save
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cnr-save")
        self._inflight: SaveHandle | None = None
        try:
            self._open()
        except BaseException:  # a Checkpointer that did not open leaves nothing open
            self._executor.shutdown(wait=False)
            self._io.close()
            self._storage.close()
            memory = getattr(self, "_memory", None)
            if memory is not None:
                memory.close(remove=False)
            raise
        _exit.track(self)  # at exit, its background work finishes before Python stops the thread pools (once whole)

    def _open(self) -> None:
        """The rest of the constructor, once the storage is open: the root listed, the chain book, the
        compactor, retention, the memory tier, the restore and commit paths."""
        config, job, tracker = self.config, self.job, self.job.tracker
        # Rank 0 lists the root once for everyone; a listing that fails raises StorageError on every rank.
        # os.urandom, not torch's RNG, which belongs to the training job.
        origin = getattr(job.model, "_cnr_warm_start", None)  # a warm start's report (cnr_torchrec.ckpt.warm_start)
        token, next_id = self._ranks.from_rank0(
            lambda: [int.from_bytes(os.urandom(7), "little"), self._open_root(origin)],
            what=f"listing the checkpoints under {config.root}",
        )
        self._store = self._make_store(token)
        self._peers = Peers(self._store, self.rank, self.world_size, config.save_timeout_s)  # every commit round's
        self._token = token
        self._book = ChainBook(next_id)  # what the next save hangs on
        self._timer = IntervalTimer()
        self._plan: IntervalPlan | None = None
        self._last_stall_s = 0.0
        self._compactor = Compactor(config.compaction, self._start_compaction)
        # Rank 0: the committed checkpoints, loaded at the first commit and then kept up to date.
        self._retention = Retention(config.retention, self._compactor.pinned)
        # This rank's restore image in host shared memory (memory_tier): the reconstruction's rows live there.
        self._memory = MemoryTier(config, tracker, rank=self.rank, world_size=self.world_size,
                                  residual=bool(config.quantization.residual), distributed=self._dist)
        self._restorer = Restorer(config, job, storage=self._storage, io=self._io, ranks=self._ranks,
                                  memory=self._memory)
        self._recovery = Recovery(self._restorer, storage=self._storage, io=self._io, ranks=self._ranks)
        self._committer = Committer(config, job, peers=self._peers, io=self._io, staging=self._staging,
                                    on_commit=self._retention.committed, reconstruction=self._reconstruction(),
                                    memory=self._memory)

    # ------------------------------------------------------------------ public

    @property
    def model(self) -> torch.nn.Module:
        """The sharded model it checkpoints (``job.model``)."""
        return self.job.model

    @property
    def tracker(self) -> DirtyRowTracker:
        """The model's dirty-row tracker (``job.tracker``)."""
        return self.job.tracker

    @property
    def dense_optimizer(self) -> DenseOptimizer | None:
        """The dense parameters' optimizer, or None (``job.dense_optimizer``)."""
        return self.job.dense_optimizer

    @property
    def extra_state(self) -> Mapping[str, Stateful]:
        """The per-rank Stateful objects it saves and restores by name (``job.extra_state``)."""
        return self.job.extra_state

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a save under ``config.interval``; call it every step, on every rank.

        With ``interval: auto`` the first call says yes (the baseline), and each save then
        plans the next from the slowest rank's step time and save stall, agreed in the save's
        all-gather, so every rank answers alike (see :mod:`cnr_torchrec.ckpt.failure_rates`).

        Raises:
            ConfigError: the config has no ``interval``.
        """
        if self.config.interval is None:
            raise ConfigError("should_save() needs 'interval' in the checkpoint config (a number of steps or auto)")
        self._timer.observe(step)
        return self._plan is None or step >= self._plan.next_step

    @property
    def restores(self) -> int:
        """Restores performed by this job so far (persisted in every manifest)."""
        return self._restores

    def save(self, step: int) -> SaveHandle:
        """Takes a checkpoint of ``step``. Returns at once; ``handle.wait()`` waits for the commit.

        Every rank must call it at the same step. Blocks only for the collective
        decision and the copy of the dirty rows to host memory. A failure on one rank
        after the decision (copying its state, writing, rank 0's commit) fails the save on
        every rank alike: each ``handle.wait()`` raises SaveFailedError naming that rank and
        the cause, and the previous checkpoint stays as it was.

        Raises:
            ConfigError: the config asks for something this save cannot do, or the model was warm-started
                from this root (raised on every rank, before anything is staged).
            RowIdOutOfRangeError, MalformedLookupError: sync-free tracking recorded a bad lookup
                on some rank since the last save (raised on every rank, before anything is staged).
        """
        t0 = time.perf_counter()
        self._check_open("save")
        self.job.materialize_init()  # a save before any restore saves the model's initial values (will_restore)
        origin = getattr(self.model, "_cnr_warm_start", None)
        if origin is not None and normal_root(self.config.root) == origin.root:
            raise ConfigError(f"this model was warm-started from {origin.root}; save it into a root of its own, not "
                              "into the root it was warm-started from")
        self._check_lookups()
        if self._inflight is not None and not self._inflight.done() and self.config.on_busy == "wait":
            self._settle(self._inflight)
        vote = self._vote(busy=self._inflight is not None and not self._inflight.done())
        if vote.busy:
            log.info("save at step %d skipped: the previous save is still writing (on_busy: skip)", step)
            return SaveHandle(step, None, None, (time.perf_counter() - t0) * 1e3)
        if self._inflight is not None:
            self._settle(self._inflight)
        decision, tip = self._decide(step, vote)
        staged, stage_error = self._stage(decision)
        if staged is not None:
            # Rows a budget-limited delta left out stay dirty (with their counts) for a later save.
            # (A rank that could not stage keeps every row dirty: the next save is a baseline anyway.)
            # A compaction's tip restarts the "since baseline" view: the rows dirty since the tip.
            self.tracker.reset(baseline=decision.kind == "baseline" or tip, keep=staged.left_out)
        self._book.decided(decision)  # until the outcome is known, assume failure: the rows are gone from the tracker
        return self._submit(step, decision, staged, stage_error, t0)

    def _decide(self, step: int, vote: SaveVote) -> tuple[Decision, bool]:
        """The save's decision from the ranks' ``vote`` (the same on every rank), after folding in a background
        compaction's outcome. Returns it and whether it is the tip of the next compaction."""
        self._book.state, hang_on_compacted = self._compactor.step(self._book.state, vote.compaction_finished,
                                                                   vote.compaction_committed)
        reconstruction = self._committer.reconstruction
        if hang_on_compacted and reconstruction is not None and self.config.quantization.residual:
            reconstruction.hang_on(self._compactor.take_folded())  # the delta codes against the folded rows
        if self.config.interval is not None:
            self._plan = plan_interval(self.config, step=step, step_s=vote.step_s, save_cost_s=vote.stall_s,
                                       world_size=self.world_size)
            log.info("next save at step %d: %s", self._plan.next_step, self._plan.why)
        decision = decide(
            policy=self.config.policy, state=self._book.state, step=step,
            dirty_since_previous=vote.dirty_since_previous, dirty_since_baseline=vote.dirty_since_baseline,
            held_rows=vote.held_rows,
            full_shard_fraction=self.config.full_shard_fraction,
            force_baseline=self._book.force_baseline, since_view=hang_on_compacted,
        )
        tip = not hang_on_compacted and self._compactor.mark_tip(decision, self._book.state)
        if tip:
            decision = dataclasses.replace(decision, reason=f"{decision.reason}; tip of the next compaction", tip=True)
        return decision, tip

    def _submit(self, step: int, decision: Decision, staged: Staged | None, stage_error: str,
                t0: float) -> SaveHandle:
        """Hands the staged save to the background writer (the stall ends here) and returns its handle."""
        stall = (time.perf_counter() - t0) * 1e3
        if staged is not None:
            staged.stall_ms = stall
        self._last_stall_s = stall / 1e3
        self._timer.exclude_pause(stall / 1e3)
        log.info("save %d at step %d: %s (%s), stall %.1f ms", decision.ckpt_id, step, decision.kind,
                 decision.reason, stall)
        future = self._executor.submit(self._committer.write, decision, staged, stage_error, self.codec,
                                       self._manifest_fields())
        handle = SaveHandle(step, decision, future, stall)
        self._inflight = handle
        return handle

    def wait(self, *, compaction: bool = False) -> CheckpointInfo | None:
        """Waits for the save in flight, if any. Raises SaveFailedError if it failed.

        Args:
            compaction: also wait for this rank's part of a background compaction in flight
                (its outcome is folded into the chain at the next save, on every rank alike).
        """
        if compaction:
            self._compactor.wait()
        if self._inflight is None:
            return None
        handle = self._inflight
        self._settle(handle)
        return handle.wait()

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first, with their metadata. Not collective: any rank may call it.

        Raises:
            CorruptCheckpointError: a manifest does not load or match its checksum.
            StorageError: the storage failed while listing or reading (an S3 ``ClientError``, an
                ``OSError``); the message names this rank and the original error.
        """
        self._check_open("list")
        try:
            manifests = {i: load_manifest(self._storage, i) for i in committed_ids(self._storage)}
            return [CheckpointInfo.from_manifest(m, chain_ids(m, manifests)) for m in manifests.values()]
        except CnrError:
            raise
        except Exception as e:
            raise as_named_error(e, self.rank, f"listing the checkpoints under {self.config.root}") from e

    @property
    def last_restore_stats(self) -> dict[str, float]:
        """Where this rank's last :meth:`restore` spent its time, by phase in ms, and the bytes and requests it
        read (see :mod:`cnr_torchrec.ckpt.restore.stats`); empty before the first restore."""
        return dict(self._restorer.stats)

    def restore(self, step: int | None = None, *, per_rank_state: str = "strict") -> int:
        """Restores the newest committed checkpoint (or the newest one of ``step``). Returns its step.

        Every rank calls it at once. Rank 0 picks the newest checkpoint (by commit, not by step:
        a job that went on from an older step restores its own branch) whose chain is sound
        as far as the manifests tell (they load and match their checksums, the chain is
        complete, every rank file exists with the size its manifest gives); every rank then
        applies what its shards need, checking each file it reads against the manifest's
        xxh3 (and each blob against its own), and the ranks compare
        outcomes before anything else happens, so a rank that finds a bad file never leaves
        the others waiting in a collective. A file that fails its checks is handled as
        ``on_corrupt`` says: ``fail`` raises CorruptCheckpointError naming it on every rank;
        ``fallback`` logs it and restores the newest older checkpoint whose chain does not
        contain it (an older chain starts from a baseline, which rewrites every row and all
        state, so whatever a failed attempt applied is overwritten). Nothing under the root
        is written or deleted.

        Args:
            step: restore the newest checkpoint of this step instead of the newest one.
            per_rank_state: what to do when the checkpoint was written by another number of
                ranks, so that per-rank state (``extra_state``, such as a data loader's
                position, and the RNG) cannot be given back rank by rank. ``"strict"``:
                IncompatibleCheckpointError if this Checkpointer has ``extra_state`` (a
                resumed reader would replay or skip samples otherwise); the RNG alone is
                dropped with a warning. ``"drop"``: restore everything else and leave the
                per-rank state as it is, with a warning.

        A restore either succeeds or leaves the model as it found it: what it may overwrite
        (this rank's shards and their optimizer state, dense parameters, the dense optimizer,
        eviction windows, ``extra_state``) is copied to host memory first and put back if it
        raises (``restore_rollback``). The global RNGs are set to the saved ones only under
        ``restore_rng``. The checkpoint of step ``s`` holds the state after step ``s``: a
        resumed job trains from ``s + 1``.

        Raises:
            CheckpointNotFoundError: nothing committed (or nothing at ``step``) under the root:
                there is nothing to restore, and a fresh start is right.
            RestoreFailedError: checkpoints (of ``step``) exist, but none could be restored (each
                one skipped is in the message and in ``.skipped``). Not a CheckpointNotFoundError:
                never start afresh on it.
            CorruptCheckpointError: ``on_corrupt: fail`` and a file of the chosen chain fails its
                checks; ``.path`` names it, on every rank.
            StorageError: the storage failed on some rank (a listing, a read: an S3 ``ClientError``,
                an ``OSError``); every rank raises it alike, naming that rank and the original error.
                Nothing under the root was changed; try again once the storage answers.
            IncompatibleCheckpointError: the checkpoint is of another model, or per-rank state
                cannot be mapped onto this world size under ``per_rank_state="strict"``.
            UnsafeCheckpointError: a manifest names a file outside its checkpoint's directory,
                or a blob of a dtype that is never written. Such a checkpoint was crafted or
                edited: it is refused, never skipped.
        """
        self._check_open("restore")
        if per_rank_state not in ("strict", "drop"):
            raise ConfigError(f"per_rank_state: {per_rank_state!r} is not one of ['strict', 'drop']")
        if self._inflight is not None:
            self._settle(self._inflight)
        self._compactor.drop("the restore")
        reconstruction = self._committer.reconstruction
        # The restore stages into the reconstruction's rows (no new memory), which it then becomes again.
        buffers = reconstruction.release() if reconstruction is not None else {}
        if not buffers:  # a fresh process: a storage restore stages straight into its memory image, if it keeps one
            buffers = self._memory.weight_views()
        try:
            chain, bad, restored = self._restorer.run(step, per_rank_state, buffers)  # restored: the staged shards
        except BaseException:
            if buffers:  # the reconstruction's rows went into a failed attempt: the next save codes no residual
                self._book.rebase("a restore failed after taking the residual reconstruction's rows")
            raise
        del buffers
        m = chain[-1]
        if reconstruction is not None:
            with timed(self._restorer.stats, "reconstruction_ms"):  # residuals are coded against what was restored
                self._reset_reconstruction(reconstruction, chain, restored,
                                           from_memory=self._restorer.stats.get("from_memory") == 1.0)
        del restored
        self.model.__dict__.pop("_cnr_warm_start", None)  # it holds this root's checkpoint now, not a warm start
        self.tracker.reset(baseline=True)
        self._continue_chain(chain)
        self._count_restore(m)
        if self._dist:
            dist.barrier()
        if bad:
            log.warning("restored checkpoint %d (step %d) instead of newer ones: %s", m.id, m.step,
                        "; ".join(f"checkpoint {i}: {why}" for i, why in sorted(bad.items())))
        log.info("restored checkpoint %d (step %d, chain %s)", m.id, m.step, [c.id for c in chain])
        return m.step

    def recover(self, failed_ranks: Iterable[int], step: int | None = None) -> RecoveryInfo:
        """CPR partial recovery: only ``failed_ranks`` reload their shards; survivors keep their live rows.

        Every rank calls it at once, the replaced ranks as fresh processes; see
        :class:`~cnr_torchrec.ckpt.restore.partial.Recovery` for what moves and what is lost.

        Args:
            failed_ranks: the ranks that failed and were replaced.
            step: recover from the newest checkpoint of this step instead of the newest one.

        Raises:
            ConfigError: ``failed_ranks`` is empty, names a rank outside the job, or names every rank
                (nothing survives: use :meth:`restore`).
            CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError, StorageError:
                as for :meth:`restore`, on every rank alike.
        """
        self._check_open("recover")
        failed = self._recovery.check(failed_ranks)
        if self._inflight is not None:
            self._settle(self._inflight)
        self._compactor.drop("a partial recovery")  # the failed ranks' trackers restart: a fold would miss their rows
        info, chain = self._recovery.run(failed, step)
        # A replaced rank built with will_restore: its shards were reloaded, its data_parallel tables broadcast.
        self.job.init_overwritten()
        self._continue_chain(chain)
        self._count_restore(chain[-1])
        rec = self._committer.reconstruction
        if rec is not None and self.rank in failed:  # survivors keep the chain's reconstruction
            self._reset_reconstruction(rec, chain, None, from_memory=False)
        return info

    @property
    def last_restore_sources(self) -> builtins.list[tuple[int, str, str]]:
        """Where each rank's last :meth:`restore` took its shards from: ``(rank, "memory" | "storage", why)``, the
        same on every rank; empty before the first restore."""
        return list(self._restorer.sources)

    def close(self, *, keep_images: bool = False) -> None:
        """Waits for the save in flight, then releases the threads and closes the storage. Idempotent.

        Args:
            keep_images: keep this rank's memory image (``memory_tier``) for a restart on this host. A clean
                ``close()`` at the end of a job removes it; leaving a ``with`` block by an exception keeps it.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._inflight is not None:
                self._settle(self._inflight)
            self._compactor.drop("close()")
        finally:
            if self._committer.reconstruction is not None:
                self._committer.reconstruction.release()  # a closed Checkpointer saves nothing: free its copy
            self._memory.close(remove=not keep_images)
            self._executor.shutdown(wait=True)
            self._io.close()
            self._committer.close()
            self._storage.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(keep_images=exc_type is not None)  # a job that fails may be restarted on this host

    # ------------------------------------------------------------------ internals

    def _reconstruction(self) -> Reconstruction | None:
        """What the committed chain restores on this rank, kept for residual coding or the memory image (its
        rows then live in the image)."""
        if not (self.config.quantization.residual or self._memory.active):
            return None
        return Reconstruction(backing=self._memory if self._memory.active else None)

    def _reset_reconstruction(self, reconstruction: Reconstruction, chain: builtins.list[Manifest],
                              restored: dict[Any, torch.Tensor] | None, from_memory: bool) -> None:
        """After a restore of ``chain`` (baseline first): the reconstruction becomes the restored rows, and the
        memory image (unless the rows came from it, sealed already) what the restore gave, sealed for the tip
        where it restores on this world size (an image is never used across world sizes)."""
        tip = chain[-1]
        if not self._memory.active or from_memory:
            reconstruction.reset(self.tracker, restored)
            return
        with self._memory.update() as image:
            reconstruction.reset(self.tracker, restored)
            if tip.world_size == self.world_size:
                image.seal(tip.id, [m.id for m in chain], payload_identity(tip.ranks[self.rank].payload),
                           live_states=True)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CheckpointerClosedError(f"rank {self.rank}: {what}() on a closed Checkpointer (close() released its "
                                          "storage); make a new Checkpointer for the same root instead")

    def _manifest_fields(self) -> JobFields:
        """The manifest's fields that describe the job rather than the save, as they are now."""
        q = self.config.quantization
        codec = codec_description(q.method, self.codec.bits, getattr(self.codec, "params", {}), q.bits)
        return JobFields(policy=self.config.policy, world_size=self.world_size, codec=codec,
                         restores=self._restores, table_fqns=self._table_fqns)

    def _stage(self, decision: Decision) -> tuple[Staged | None, str]:
        """``stage()`` of ``decision``: (staged, "") or, if this rank failed, (None, why).

        A failure is not raised here: the other ranks have staged and will wait for rank 0's
        verdict, so it goes to the commit protocol as this rank's report, and the save then
        fails on every rank alike. A ConfigError depends only on the decision and config, so
        every rank raises it at once, before anything is staged.
        """
        try:
            staged = stage(decision, self.job, rank=self.rank, world_size=self.world_size,
                           budget=self.config.budget, buffers=self._staging)
        except ConfigError:
            raise
        except Exception as e:  # reported through the commit protocol, so that no rank waits for it
            log.error("save %d: rank %d could not copy its state to host memory", decision.ckpt_id, self.rank,
                      exc_info=True)
            return None, f"could not copy its state to host memory: {type(e).__name__}: {e}"
        return staged, ""

    def _settle(self, handle: SaveHandle) -> None:
        """Waits for ``handle`` and folds its outcome into the chain state (once)."""
        if handle.decision is None:
            return  # a save on_busy: skip dropped: nothing was written, so the chain is as it was
        try:
            info = handle.wait()
        except SaveFailedError as e:
            info = None
            log.warning("%s", e)
        self._book.settle(handle.decision, None if info is None else info.nbytes)

    def _start_compaction(self, new_id: int, chain: tuple[int, ...]) -> Compaction:
        return Compaction(new_id, chain, self.job, config=self.config, peers=self._peers, io=self._io,
                          on_commit=self._retention.committed)

    def _make_store(self, token: int) -> Any:
        """The c10d store, under keys namespaced by ``token`` (the same on every rank)."""
        if not self._dist:
            return None
        # Keys are namespaced per Checkpointer: a stale report of an earlier one must never be read.
        return dist.PrefixStore(f"cnr/{token}", dist.distributed_c10d._get_default_store())

    def _open_root(self, origin: Any) -> int:
        """Rank 0, once: the first free id, after recording warm start ``origin`` as the root's origin if the
        root holds no checkpoint yet (:mod:`~cnr_torchrec.ckpt.format.origin`)."""
        if origin is not None and not committed_ids(self._storage):
            write_origin(self._storage, origin)
        return self._next_id(-1)

    def _next_id(self, newest: int) -> int:
        """The id after every checkpoint directory under the root and after ``newest`` (rank 0 lists)."""
        return max(existing_dir_ids(self._storage) + [newest]) + 1

    def _check_lookups(self) -> None:
        """Raises, on every rank, a bad lookup that sync-free tracking recorded on any rank.

        Sync-free tracking (CUDA) raises a lookup's problems at the next query, and the
        save's first query is a collective: a rank raising alone would leave the others
        waiting in it. Tracking that raises in the forward (CPU) needs no exchange.
        """
        if not self.tracker.sync_free:
            return
        failure, cause = None, None
        try:
            self.tracker.check_lookups()
        except CnrError as e:
            failure, cause = Failure.of(e, self.rank, "checking the lookups tracked since the last save"), e
        self._ranks.raise_any(failure, cause)

    def _vote(self, busy: bool) -> SaveVote:
        """Every rank's vote on this save (:mod:`~cnr_torchrec.ckpt.save.vote`), in one all-gather."""
        tables = self.tracker.tables()
        prev = self.tracker.dirty_counts()
        base = self.tracker.dirty_counts(since_baseline=True) if self.tracker.has_baseline_view else prev
        held = {t: sum(r1 - r0 for (r0, r1) in {rows for rows, _ in self.tracker.shard_ranges(t)}) for t in tables}
        finished, committed = self._compactor.flags()
        mine = SaveVote(dirty_since_previous=prev, dirty_since_baseline=base, held_rows=held,
                        step_s=self._timer.step_s, stall_s=self._last_stall_s, compaction_finished=finished,
                        compaction_committed=committed, busy=busy)
        return mine.gather(tables, self._ranks.all_gather)

    def _pick_codec(self) -> Codec:
        """The codec for the next saves: configured bits, or ``bits: auto`` from the restores expected and done."""
        bits, why = bits_for_job(self.config, self._restores)
        q = self.config.quantization
        codec = get_codec(q.method, bits, **q.params)  # the config's check took these (every width, under auto)
        if q.bits == "auto":
            previous = getattr(self, "codec", None)
            if previous is None or previous.bits != codec.bits:
                level = logging.WARNING if previous is not None else logging.INFO
                log.log(level, "bits: auto -> %s-bit %s: %s", bits, q.method, why)
        return codec

    def _continue_chain(self, chain: builtins.list[Manifest]) -> None:
        """Chain state after a restore of ``chain``: consecutive goes on from its tip; others take a baseline.

        Collective: rank 0 lists the root, and a failure raises StorageError on every rank.
        """
        m = chain[-1]
        next_id = self._ranks.from_rank0(lambda: self._next_id(m.id),
                                         what=f"listing the checkpoints under {self.config.root}")
        self._book.after_restore([(c.id, c.nbytes) for c in chain], next_id,
                                 goes_on=self.config.policy == "consecutive")

    def _count_restore(self, manifest: Manifest) -> None:
        """After a restore: one more restore for this job, and maybe wider codes (bits: auto)."""
        self._restores = manifest.restores + 1
        self.codec = self._pick_codec()
