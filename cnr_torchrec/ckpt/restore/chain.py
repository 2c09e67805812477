"""Restore: apply a baseline and its deltas to whatever shards this rank holds now.

The chain is applied newest checkpoint first (:class:`~cnr_torchrec.ckpt.restore.apply.Applier`).
For each checkpoint, every entry's row ids are read and the rows this rank still needs are
claimed; then the reads of exactly those rows start, all at once
(:class:`~cnr_torchrec.ckpt.format.bytes.rows.RowReader`), and the entries are decoded as their rows
land. The walk stops early once every row is restored. A residual chain's claims are made the same
way, newest first, and applied oldest first, since its rows are sums taken in that order
(:mod:`~cnr_torchrec.ckpt.format.precedence`). Then what every rank holds alike (dense parameters,
the dense optimizer, the TBE step counter) comes from rank 0's file of the tip, and per-rank
state (extra_state, RNG, managed-collision eviction windows) from this rank's own, when the
world size is the one that saved. A managed-collision table whose slots moved is relocated
by raw id instead (:mod:`~cnr_torchrec.ckpt.restore.relocate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cnr_torchrec.ckpt.format.bytes.chunks import IOPool
from cnr_torchrec.ckpt.format.bytes.payload import unflatten_state
from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport
from cnr_torchrec.ckpt.format.placement import reports_for
from cnr_torchrec.ckpt.format.precedence import newest_first
from cnr_torchrec.ckpt.job_state import DenseOptimizer, JobState
from cnr_torchrec.ckpt.layout import shard_boxes
from cnr_torchrec.ckpt.live.dense_optim import load_dense_state
from cnr_torchrec.ckpt.live.dense_params import dense_named_state, non_persistent_buffers
from cnr_torchrec.ckpt.live.rng import set_rng_state
from cnr_torchrec.ckpt.memory.tier import Candidate, image_tables
from cnr_torchrec.ckpt.restore.apply import Applier
from cnr_torchrec.ckpt.restore.compat import check_compatible
from cnr_torchrec.ckpt.restore.from_memory import restore_from_image
from cnr_torchrec.ckpt.restore.host_copies import Key, StagedWeights
from cnr_torchrec.ckpt.restore.relocate import needs_relocation, relocate_tables
from cnr_torchrec.ckpt.restore.stats import timed
from cnr_torchrec.ckpt.restore.threads import wider_pool
from cnr_torchrec.errors import CnrError, CorruptCheckpointError, IncompatibleCheckpointError
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.track.tbe_cache import invalidate_caches

__all__ = ["RestoreOptions", "restore_chain", "restore_dense_optimizer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreOptions:
    """How one application of a chain goes: what it restores besides the shards, and how it reads.

    Attributes:
        replicated: also restore what every rank holds alike: data_parallel tables, dense
            parameters, the dense optimizer and the TBE step counter. Partial recovery
            leaves them out and takes them from a surviving rank instead.
        rng: also set the global RNG states to this rank's saved ones (config ``restore_rng``).
        stage: leave the live weights that can be staged (:func:`~.apply.can_stage`) as they are until the
            caller commits (every rank succeeded): a residual chain adds up into host copies of them; a plain
            chain reads and checks every byte first, and decodes in place at the commit (optimizer states and
            managed-collision state with it; the rollback's snapshot holds those).
        pool: threads that read the chunks; every file a checkpoint needs is read at once,
            and its entries are decoded as their chunks land.
        threads: the intra-op threads the rows are checked and decoded on (:mod:`.threads`).
        stats: if given, ``bytes_read`` and ``reads`` (requests) are added to it, and the time
            of each phase (:mod:`~cnr_torchrec.ckpt.restore.stats`).
    """

    replicated: bool = True
    rng: bool = False
    stage: bool = False
    pool: IOPool | None = None
    threads: int = 1
    stats: dict[str, float] | None = None


def restore_chain(
    manifests: list[Manifest],
    job: JobState,
    *,
    storage: Storage,
    rank: int,
    world_size: int,
    options: RestoreOptions = RestoreOptions(),
    buffers: Mapping[Key, torch.Tensor] | None = None,
    image: Candidate | None = None,
) -> StagedWeights:
    """Applies ``manifests`` (baseline first) to this rank's part of ``job``: its shards, and (as ``options``
    say) the replicated state and the per-rank state, ``extra_state`` and RNG, where ``world_size`` ranks wrote
    the tip.

    Args:
        options: what to restore besides the shards, and how to read.
        buffers: float32 host tensors to stage into, by shard key (a residual reconstruction's rows, which the
            restore may overwrite); a shard without one of its shape gets a new copy.
        image: this rank's memory-tier image, sealed for ``manifests`` on this layout
            (:meth:`~cnr_torchrec.ckpt.memory.tier.MemoryTier.candidate`): the shards come from it, and
            storage gives the rest (data_parallel tables, dense and per-rank state); if its bytes fail their
            check (``image.checked`` is then False), storage gives the shards too.

    Returns:
        The staged weights: committed already unless ``options.stage``.
    """
    target = manifests[-1]
    tracker, stats = job.tracker, options.stats
    check_compatible(target, tracker)
    relocated = needs_relocation(manifests, tracker, rank, world_size)  # managed-collision tables, by raw id
    from_image = None
    skip = set(relocated)
    if image is not None:
        with timed(stats, "memory_ms"):
            from_image = restore_from_image(image, tracker, options.stage, job.deferred_init)
        if from_image is None:  # its bytes failed the seal's checksum: storage gives the shards too
            log.warning("rank %d: %s; the shards are restored from storage", rank, image.why)
        else:
            skip |= set(image_tables(tracker))
            relocated = set()  # the image is of this layout: nothing moved
    with wider_pool(options.threads):
        read, staged = _apply_chain(manifests, storage, tracker, rank, options, skip, buffers)
        if not options.stage:
            staged.commit()
        if from_image is not None:
            staged = StagedWeights(from_image.entries + staged.entries, from_image.restored + staged.restored,
                                   staged.pending)
        if relocated:
            with timed(stats, "relocate_ms"):
                relocate_tables(relocated, manifests, storage, tracker, rank, world_size)

    def reader(r: int) -> RowReader:  # the tip's file of rank r: its reader, else a few range reads of it
        load = read.get(r)
        return load if load is not None else RowReader(storage, target.ranks[r].payload, stats)

    with timed(stats, "state_ms"):
        if options.replicated:
            _restore_replicated(target, job, reader(0))
        if target.world_size == world_size:  # an import's too (written without the rest of the per-rank state)
            _restore_mc_runtime(target.ranks[rank], reader(rank), tracker, relocated)
        if target.world_size != world_size or not target.per_rank_state:
            # Named only where the tip's world size is this one: across world sizes, none of it could be.
            kept = sorted(job.extra_state) if target.world_size == world_size else []
            log.warning(
                "checkpoint %d was written by %d ranks and is restored onto %d: embedding rows, dense and optimizer "
                "state are resharded; per-rank state (%s, RNG) is not restored",
                target.id, target.world_size, world_size, ", ".join(kept) or "no extra_state",
            )
            return staged
        _restore_rank_state(target, target.ranks[rank], reader(rank), job.extra_state, options.rng)
    return staged


def _apply_chain(manifests: list[Manifest], storage: Storage, tracker: DirtyRowTracker, rank: int,
                 options: RestoreOptions, relocated: set[str], buffers: Mapping[Key, torch.Tensor] | None
                 ) -> tuple[dict[int, RowReader], StagedWeights]:
    """The chain's entries onto this rank's shards (but those of the ``relocated`` tables), newest checkpoint
    first, each row read, decoded and copied once (into host copies where ``options.stage``). Returns the readers
    of the tip's files, by rank (dense and per-rank state are there too), and the staged weights.

    Only the reports that can hold this rank's rows are read (:func:`~cnr_torchrec.ckpt.format.placement.reports_for`):
    on the plan that saved a format 7 checkpoint, the rank's own part (and rank 0's, for data_parallel tables)."""
    target = manifests[-1]
    replicated, stats = options.replicated, options.stats
    boxes = shard_boxes(tracker)
    data_parallel = any(tracker.is_data_parallel(t) for t in tracker.tables())

    def sources(m: Manifest) -> Sequence[RankReport]:
        return reports_for(m, rank, boxes, data_parallel)

    # Timed apart from the plan: a residual chain's host copies are zeroed here, which is new memory's first
    # touch (staged_copy_bytes of it) and grows with the shard bytes, not with the rows claimed.
    with timed(stats, "stage_ms"):
        applier = Applier(tracker, manifests, replicated, stats, exclude=relocated, stage=options.stage,
                          buffers=buffers, sources=sources)
    tip: dict[int, RowReader] = {}
    tables = [t for t in tracker.tables() if t not in relocated and (replicated or not tracker.is_data_parallel(t))]
    if applier.checks_first:
        return tip, _check_chain(manifests, storage, tracker, applier, options, sources, tip, tables)
    try:
        claimed: list[list[tuple[RowReader, Any]]] = []  # an additive chain's work, newest checkpoint first
        for m in newest_first(manifests):
            if applier.done():
                break
            with timed(stats, "plan_ms"):
                work = _plan_checkpoint(m, sources(m), storage, applier, options,
                                        tip if m is target else None, prefetch=not applier.additive)
            if not applier.additive:  # each row is written once, by its newest copy: apply as the chain is read
                _apply_work(applier, work, stats)
                continue
            applier.refresh()
            claimed.append(work)
        # A residual chain adds up oldest copy first (format/precedence.py): its claims, made newest first, are
        # applied in the other order, each checkpoint's reads started while the one before it is applied.
        ordered = claimed[::-1]
        for i, work in enumerate(ordered):
            for load, plan in work if i == 0 else ():
                load.prefetch(plan.entry, plan.sel)
            for load, plan in ordered[i + 1] if i + 1 < len(ordered) else ():
                load.prefetch(plan.entry, plan.sel)
            _apply_work(applier, work, stats)
        # Every row this rank restores from the chain has had a whole copy (the walk stops early only once the
        # tables it found entries of are done: a table none of the parts it read holds is caught here too).
        applier.check_complete(tracker, manifests[0], tables)
        staged = applier.finish()
    finally:
        # fused_uvm_caching: the restored rows went to the weights behind the cache, whose lines
        # are stale now (even after a failure part way, when the rows are a mix).
        invalidate_caches(tracker.tbes())
    return tip, staged


def _check_chain(manifests: list[Manifest], storage: Storage, tracker: DirtyRowTracker, applier: Applier,
                 options: RestoreOptions, sources: Callable[[Manifest], Sequence[RankReport]],
                 tip: dict[int, RowReader], tables: Sequence[str]) -> StagedWeights:
    """A staged plain chain (:attr:`~.apply.Applier.checks_first`): claims every checkpoint's rows newest first,
    and reads and checks every byte it will apply (CRCs, the codec's layout, the shapes), writing nothing.
    Returns the writes, for the commit once every rank has got this far: the checked rows decoded into the
    live weights in place (a host copy of a shard only where the caller gave a buffer).

    On a local root the rows are checked where they lie in the mapped files, and copied out at the commit
    (the files of a committed checkpoint are never rewritten); elsewhere the checked bytes are kept until then,
    as stored (encoded: a quarter or less of their float32 rows).

    Raises:
        CorruptCheckpointError: a file fails its checks, or the chain holds no copy of some row (then nothing
            was written).
    """
    target, stats = manifests[-1], options.stats
    claimed: list[list[tuple[RowReader, Any]]] = []  # every checkpoint's work, newest first
    for m in newest_first(manifests):
        if applier.done():
            break
        with timed(stats, "plan_ms"):
            work = _plan_checkpoint(m, sources(m), storage, applier, options, tip if m is target else None,
                                    prefetch=True)
        with timed(stats, "check_rows_ms"):
            for load, plan in work:
                applier.check(plan, load.check(plan.entry, plan.sel), load.payload.file)
        applier.close_checkpoint([plan for _, plan in work])
        claimed.append(work)
    applier.check_complete(tracker, manifests[0], tables)

    def decode_in_place() -> StagedWeights:
        try:
            with wider_pool(options.threads):
                for work in claimed:
                    _apply_work(applier, work, stats)
                return applier.finish()
        finally:
            invalidate_caches(tracker.tbes())  # fused_uvm_caching: the cache's lines are stale now

    return StagedWeights([], pending=decode_in_place)


def _plan_checkpoint(m: Manifest, reports: Sequence[RankReport], storage: Storage, applier: Applier,
                     options: RestoreOptions, tip: dict[int, RowReader] | None,
                     prefetch: bool) -> list[tuple[RowReader, Any]]:
    """Claims what the entries of checkpoint ``m``'s ``reports`` give this rank. Returns (reader, plan) per entry
    with rows to apply; their reads start now with ``prefetch``. ``tip``: where to keep ``m``'s readers by rank."""
    work = []
    wanted = []
    for report in reports:
        load = RowReader(storage, report.payload, options.stats, pool=options.pool)
        if tip is not None:
            tip[report.rank] = load
        todo = [(t, e) for t, e in m.rows_of(report, options.replicated) if applier.wants(t, e)]
        load.fetch_blobs([b.blob for _, e in todo for b in (e.ids, e.whole) if b is not None])
        wanted.append((load, todo))
    for load, todo in wanted:
        for table, entry in todo:
            plan = applier.plan(table, entry, load)
            if plan is not None:
                if prefetch:
                    load.prefetch(entry, plan.sel)  # every read of this checkpoint starts now
                work.append((load, plan))
    return work


def _apply_work(applier: Applier, work: list[tuple[RowReader, Any]], stats: dict[str, float] | None) -> None:
    """Decodes one checkpoint's claimed rows into place, then merges its row-wise states."""
    with timed(stats, "apply_ms"):
        for load, plan in work:
            applier.apply(plan, load.rows(plan.entry, plan.sel))
        applier.finish_checkpoint()


def _restore_rank_state(target: Manifest, mine: RankReport, load: RowReader,
                        extra_state: Mapping[str, Any], rng: bool) -> None:
    """This rank's extra_state and (with ``rng``) RNG state, from its own report of ``target``."""
    unknown = sorted(set(extra_state) - set(mine.extra))
    if unknown:
        raise IncompatibleCheckpointError(
            f"extra_state {unknown} is not in checkpoint {target.id} (it has {sorted(mine.extra)})"
        )
    try:
        for name, obj in extra_state.items():
            obj.load_state_dict(unflatten_state(mine.extra[name], load))
        if rng:
            set_rng_state(unflatten_state(mine.rng, load))
    except CnrError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
        raise CorruptCheckpointError(
            f"{mine.file}: this rank's saved extra_state or RNG state is malformed ({type(e).__name__}: {e}); the "
            f"manifest of checkpoint {target.id} was edited or crafted", path=mine.file) from None


def _restore_mc_runtime(mine: RankReport, load: RowReader, tracker: DirtyRowTracker, relocated: set[str]) -> None:
    """The eviction windows and counters of this rank's managed-collision modules, from its own report (the
    relocated tables have theirs already)."""
    for table, mc in tracker.mc_tables().items():
        if table in relocated:
            continue
        if table not in mine.mc_runtime:
            raise IncompatibleCheckpointError(
                f"{mine.file} holds no eviction window of managed-collision table '{table}'; the checkpoint was "
                "written for a model without that module")
        try:
            mc.load_runtime(unflatten_state(mine.mc_runtime[table], load))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{mine.file}: the saved eviction window of table '{table}' is malformed ({e}); the manifest of "
                "this checkpoint was edited or crafted", path=mine.file) from None


def _restore_replicated(target: Manifest, job: JobState, load0: RowReader) -> None:
    """Dense parameters, the dense optimizer and the TBE step counter, from rank 0's file of ``target``."""
    model, tracker, dense_optimizer = job.model, job.tracker, job.dense_optimizer
    first = target.ranks[0]
    dense = dense_named_state(model, tracker.module_fqns())
    transient = non_persistent_buffers(model)  # absent from a checkpoint imported from a state_dict: left as is
    dense = {n: t for n, t in dense.items() if n in first.dense or n not in transient}
    missing = sorted(set(dense) - set(first.dense))
    if missing:
        raise IncompatibleCheckpointError(
            f"dense parameters {missing} are not in checkpoint {target.id}; the model's dense part changed"
        )
    with torch.no_grad():
        for name, t in dense.items():
            saved = load0(first.dense[name])
            if saved.shape != t.shape:
                raise IncompatibleCheckpointError(
                    f"dense parameter '{name}' is {list(t.shape)} in the model, {list(saved.shape)} in the checkpoint"
                )
            t.copy_(saved)
    if dense_optimizer is not None:
        restore_dense_optimizer(target, None, model, dense_optimizer, load0=load0)

    for tbe in tracker.tbes():
        it = getattr(tbe, "iter", None)
        if isinstance(it, torch.Tensor) and it.numel() == 1:
            it.fill_(max(r.tbe_iter for r in target.summaries))


def restore_dense_optimizer(target: Manifest, storage: Storage | None, model: nn.Module,
                            dense_optimizer: DenseOptimizer, stats: dict[str, float] | None = None,
                            load0: RowReader | None = None) -> None:
    """Only the dense optimizer's state, from rank 0's file of ``target`` (partial recovery needs its layout),
    in the form its class saved it in: by parameter name for torch.optim and TorchRec's keyed optimizers,
    through the optimizer's own ``load_state_dict`` for any other (see dense_optim.py). ``load0``: a reader
    of that file already at hand (else ``storage`` is range-read).

    Raises:
        IncompatibleCheckpointError: the checkpoint holds no dense optimizer state, another optimizer class
            saved it, or its state does not fit this optimizer's parameters.
        CorruptCheckpointError: the saved state is malformed for its form.
    """
    first = target.ranks[0]
    if first.dense_optimizer is None:
        raise IncompatibleCheckpointError(
            f"checkpoint {target.id} holds no dense optimizer state; pass dense_optimizer=None to restore it"
        )
    if load0 is None:
        if storage is None:
            raise ValueError("restore_dense_optimizer needs the storage or a reader of rank 0's file")
        load0 = RowReader(storage, first.payload, stats)
    saved = unflatten_state(first.dense_optimizer, load0)
    load_dense_state(model, dense_optimizer, saved, f"checkpoint {target.id}")
