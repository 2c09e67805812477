"""Background compaction: the ranks fold the chain being written into a new baseline, from storage.

DECK's shape: trainers write only deltas, and a merge decoupled from training folds them
into a baseline. Here every rank merges the rows of its current shards (no rank reads the
whole model) on a thread of its own, keeping each row's stored bytes
(:mod:`cnr_torchrec.ckpt.compact.merge`), and the result commits like a save, in the same round
(:mod:`cnr_torchrec.ckpt.commit_round`): per-rank reports to rank 0 through the c10d store, then rank 0
writes the sealed manifest.

How it meets the saves (all of it agreed through the saves' all-gather, so that every rank
takes the same decisions):

1. A save whose delta brings the chain to the trigger is the compaction's *tip* ``t``:
   staging it also restarts the tracker's "since baseline" view, which from then on holds
   the rows dirty since ``t``.
2. The save after ``t`` committed reserves the compacted checkpoint's id ``c`` and starts
   the merge of ``t``'s chain. Deltas go on meanwhile, on the old chain.
3. Once every rank's merge has finished, the next save hangs on ``c``: a delta of the rows
   dirty since ``t``, whose parent is ``c``. ``c`` restores exactly what ``t`` does (a residual
   chain's fold: within one 8-bit step, and the job's reconstruction moves to it, fold.py), so
   that delta restores the model as it stands. The old chain is no longer needed by the newest
   checkpoints, and retention collects it.

A merge that fails (or a root that changed under it) leaves the chain as it was: the
deltas simply go on, and a later save tries again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cnr_torchrec.ckpt import fault_injection
from cnr_torchrec.ckpt.commit_round import Outcome, Peers, Report
from cnr_torchrec.ckpt.compact import fold, merge
from cnr_torchrec.ckpt.config import CheckpointConfig, CompactionConfig
from cnr_torchrec.ckpt.format.blocks import Region, shard_key
from cnr_torchrec.ckpt.format.bytes.chunks import IOPool
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import load_manifest, manifest_path, remove_partial, seal, walk_chain
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.parts import with_parts, write_part
from cnr_torchrec.ckpt.format.placement import fits
from cnr_torchrec.ckpt.format.schema import check_manifest
from cnr_torchrec.ckpt.format.writing import ChainLinks, JobFields, manifest_body
from cnr_torchrec.ckpt.job_state import JobState
from cnr_torchrec.ckpt.layout import shard_boxes
from cnr_torchrec.ckpt.save.planner import ChainState, Decision
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["Compaction", "Compactor", "regions_of_tracker"]

log = logging.getLogger(__name__)



def regions_of_tracker(tracker: DirtyRowTracker, rank: int) -> list[Region]:
    """The blocks of the tables this rank writes in a merge: its shards under the current plan, and on
    rank 0 every data-parallel table whole (every rank holds those alike)."""
    regions = []
    for table in tracker.tables():
        if tracker.is_data_parallel(table):
            shape = tracker.table_shape(table)
            if rank == 0 and shape is not None:
                regions.append(Region(table, (0, int(shape[0])), (0, int(shape[1]))))
            continue
        for rows, cols in sorted(set(tracker.shard_ranges(table))):
            _, rows2, cols2 = shard_key(table, rows, cols)
            regions.append(Region(table, rows2, cols2))
    return regions


class Compaction:
    """One compaction of chain ``chain`` (ids, baseline first) into checkpoint ``new_id``, in flight.

    Args:
        job: the job's state, whose tracker says which blocks this rank writes (its shards under the plan).
        config: the Checkpointer's config: the chunk size, and whether the job codes residuals (then the
            chain is folded whatever it holds, and the rank keeps the folded rows, :attr:`folded`, for its
            reconstruction).
        peers: the ranks the commit round runs among (the Checkpointer's c10d store, its timeout).
        io: the threads that write chunks; it opens a Storage for the compaction's thread (Storage is not
            thread-safe).
        on_commit: rank 0 calls it with the committed manifest (to update the catalog).
    """

    def __init__(self, new_id: int, chain: tuple[int, ...], job: JobState, *, config: CheckpointConfig,
                 peers: Peers, io: IOPool, on_commit: Callable[[Manifest, Storage], None]) -> None:
        self.new_id, self.chain, self.rank, self.world_size = new_id, chain, peers.rank, peers.world_size
        self.residual = bool(config.quantization.residual)
        self.folded: dict[fold.Key, Any] = {}  # this rank's encoded folded rows, per region (residual jobs)
        self._chunk_bytes, self._io = config.chunk_bytes, io
        self._tracker = job.tracker
        self._peers = peers
        self._on_commit = on_commit
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cnr-compact")
        self._future: Future = self._executor.submit(self._run)

    @property
    def tip(self) -> int:
        return self.chain[-1]

    def finished(self) -> bool:
        """Whether this rank's part is over (its outcome known); the ranks agree on it through the saves."""
        return self._future.done()

    def outcome(self) -> Outcome:
        """Waits for this rank's part and returns the outcome every rank shares."""
        out = self._future.result()
        self._executor.shutdown(wait=False)
        return out

    # ------------------------------------------------------------------ the thread

    def _run(self) -> Outcome:
        t0 = time.perf_counter()
        storage: Storage | None = None
        try:  # whatever fails here is reported to rank 0, so that every rank hears the same outcome
            regions = regions_of_tracker(self._tracker, self.rank)  # the plan's layout: fixed while training runs
            storage = self._io.open_storage()
            chain = walk_chain(load_manifest(storage, self.tip), lambda i: load_manifest(storage, i))
            if tuple(c.id for c in chain) != self.chain:
                raise RuntimeError(f"checkpoint {self.tip}'s chain is {[c.id for c in chain]} on storage, not "
                                   f"{list(self.chain)}")
            merged = self._merge(storage, chain, regions)
            # The layout is claimed where the merged blocks fit this rank's regions (rank 0 drops every rank's
            # claim unless all of them fit: format/placement.py, reports_for).
            fit = fits(merged, [(g.table, g.rows, g.cols) for g in regions])
            report = write_part(storage, self.new_id, merged, shard_boxes(self._tracker) if fit else None)
            fault_injection.hit("compact.after_write")
        except Exception as e:  # reported to rank 0, which will not commit
            log.error("compaction %d: rank %d failed to merge: %s: %s", self.new_id, self.rank, type(e).__name__, e)
            report, chain = {"rank": self.rank, "ok": False, "error": f"{type(e).__name__}: {e}"}, []
        try:
            round_ = self._peers.round(f"compact/{self.new_id}")
            out = round_.run(Report.of_part(report), lambda reports: self._commit(reports, chain, storage, t0))
            if out.ok and out.manifest is not None:  # rank 0, which committed
                assert storage is not None  # the commit wrote through it
                self._on_commit(out.manifest, storage)
            if not out.ok:
                self._cleanup(storage)
            return out
        finally:
            if storage is not None:
                storage.close()

    def _merge(self, storage: Storage, chain: list[Manifest], regions: list[Region]) -> dict[str, Any]:
        """This rank's file: a lossless merge, or for a residual chain (or job) a fold of its sums (fold.py)."""
        tip = chain[-1]
        same_ranks = tip.world_size == self.world_size and tip.per_rank_state
        out = merge.CompactedFile(self.new_id, self.rank, rank_state=tip.ranks[self.rank] if same_ranks else None,
                                  dense_state=tip.ranks[0] if self.rank == 0 else None,
                                  chunk_bytes=self._chunk_bytes, pool=self._io)
        if not _folds(chain, self.residual):
            return merge.merge_rank(storage, chain, regions, out)
        return fold.fold_rank(storage, chain, regions, out, keep=self.folded.__setitem__ if self.residual else None)

    def _commit(self, reports: list[Report], chain: list[Manifest], storage: Storage | None, t0: float) -> Outcome:
        """Rank 0's decision in the round: the compacted manifest written if every rank's part is."""
        bad = [f"rank {r.rank}: {r.error}" for r in reports if not r.ok]
        if bad:
            return Outcome(False, "; ".join(bad))
        assert storage is not None  # rank 0's own part is good, so it opened its storage
        body = compacted_body(chain, sorted((dict(r.part) for r in reports), key=lambda p: p["rank"]), self.new_id,
                              self.world_size, (time.perf_counter() - t0) * 1e3,
                              folded=fold.FOLDED_CODEC if _folds(chain, self.residual) else None)
        manifest = with_parts(check_manifest(body, manifest_path(self.new_id)), storage)
        fault_injection.hit("compact.before_manifest")
        storage.write_atomic(manifest_path(self.new_id), seal(body, key=storage.key))
        fault_injection.hit("compact.after_manifest")
        return Outcome(True, facts={"nbytes": manifest.nbytes}, manifest=manifest)

    def _cleanup(self, storage: Storage | None) -> None:
        """A compaction that did not commit: its manifest (rank 0: in case the others were not told) and files."""
        try:
            remove_partial(storage or self._io.open_storage(), self.new_id, self.rank)
        except Exception as e:
            log.warning("could not remove the partial files of compaction %d: %s", self.new_id, e)


def _folds(chain: list[Manifest], residual_job: bool) -> bool:
    """Whether compacting ``chain`` folds it (fold.py) rather than merging it: a residual chain, or any chain of
    a job that codes residuals (whose reconstruction needs the folded rows). The same on every rank."""
    return residual_job or fold.is_residual(chain)


def compacted_body(chain: list[Manifest], parts: list[dict[str, Any]], new_id: int, world_size: int,
                   write_ms: float, *, folded: dict[str, Any] | None, recoded: dict[str, Any] | None = None,
                   by: str = "") -> dict[str, Any]:
    """The manifest body of ``chain`` compacted into baseline ``new_id`` by ``world_size`` ranks, from their parts
    (what :func:`~cnr_torchrec.ckpt.format.parts.write_part` returned, by rank).

    Args:
        folded: the codec fold.py wrote the sums with; None: a lossless merge.
        recoded: the codec every row was encoded again with, whole, in the tip's layout, which then stores the
            tip's replicated tables as entries (``cnr compact --method``); None: not re-encoded.
        by: who compacted it, for the manifest's reason (such as " by cnr compact").
    """
    tip = chain[-1]
    for p in parts:
        p["line"]["write_ms"] = round(write_ms, 3)
    if not all("layout" in p["line"] for p in parts):  # a rank's blocks spill over others' shards: no rank
        for p in parts:                                 # may read its own part alone, nor trust the shards
            p["line"].pop("layout", None)
            p.pop("boxes", None)
    span = f"chain {chain[0].id}..{tip.id} ({len(chain)} checkpoints)"
    whole = folded is not None or recoded is not None  # every row written whole (fold.py, or re-encoded)
    reason = f"folded from {span}{by}" if folded is not None else f"compacted from {span}{by}"
    links = ChainLinks.baseline(new_id, tip.step, {t: "full" if whole else "rows" for t in tip.tables}, reason)
    codec = recoded if recoded is not None else folded if folded is not None else tip.codec
    job = JobFields(policy=tip.policy, world_size=world_size, codec=dict(codec), restores=tip.restores,
                    table_fqns=tip.table_fqns)
    replicated = list(tip.replicated) if recoded is not None else []
    return manifest_body(links, job, tables=tip.tables, parts=parts, replicated=replicated, equals=tip.id,
                         compacted_from=(chain[0].id, tip.id), per_rank_state=all(p["rng"] for p in parts))


class Compactor:
    """The compaction side of a Checkpointer: it marks tips, starts merges and folds them.

    Its decisions depend only on the chain state and on the flags of the saves' all-gather
    (:meth:`flags`), so every rank takes the same ones.

    Args:
        config: the ``compaction`` section (None: never compacts).
        start: builds the :class:`Compaction` of a chain into a new id.
    """

    def __init__(self, config: CompactionConfig | None, start: Callable[[int, tuple[int, ...]], Compaction]) -> None:
        self.config, self._start = config, start
        self.tip: int | None = None  # the delta chosen as the next compaction's tip, until it commits
        self.running: Compaction | None = None
        self.folded: dict[fold.Key, Any] | None = None  # the folded rows of the compaction the next delta hangs on

    def flags(self) -> tuple[bool, bool]:
        """This rank's part of the save's vote: its part of the compaction is over; and it heard it commit."""
        running = self.running
        finished = running is not None and running.finished()
        return finished, running is not None and finished and running.outcome().ok  # at hand once finished

    def step(self, state: ChainState, finished: bool, committed: bool) -> tuple[ChainState, bool]:
        """At a save, before its decision: folds a compaction every rank has ``finished``, or starts one
        whose tip has committed. Returns the chain state, and whether the save's delta hangs on a
        compacted baseline. A compaction some rank did not hear commit is folded nowhere: it stays
        an ordinary baseline, which retention collects."""
        comp = self.running
        if comp is not None and finished:
            self.running = None
            out = comp.outcome()
            if committed and comp.tip in state.chain and state.chain[0] == comp.chain[0]:
                log.info("compaction: checkpoint %d holds chain %d..%d; the next delta hangs on it", comp.new_id,
                         comp.chain[0], comp.tip)
                self.folded = comp.folded if comp.residual else None
                return ChainState(state.next_id, (comp.new_id,), int(out.facts["nbytes"]), ()), True
            why = (f"failed: {out.error}" if not out.ok else "did not commit on every rank" if not committed
                   else "is moot: the chain changed meanwhile")
            log.warning("compaction %d of chain %d..%d %s; the chain goes on as it was", comp.new_id, comp.chain[0],
                        comp.tip, why)
        elif comp is None and self.tip is not None and state.chain and state.chain[-1] == self.tip:
            log.info("compaction %d of chain %d..%d starts in the background", state.next_id, state.chain[0],
                     self.tip)
            self.running, self.tip = self._start(state.next_id, state.chain), None
            return dataclasses.replace(state, next_id=state.next_id + 1), False
        elif self.tip is not None and self.tip not in state.chain:
            self.tip = None  # the tip's save failed
        return state, False

    def take_folded(self) -> dict[fold.Key, Any]:
        """This rank's folded rows of the compaction the next delta hangs on (a residual job's fold), handed over
        once: the reconstruction keeps them until that delta commits."""
        out, self.folded = self.folded or {}, None
        return out

    def mark_tip(self, decision: Decision, state: ChainState) -> bool:
        """Whether ``decision`` (a delta) brings the chain to the trigger with no compaction under way; if so
        it becomes the next compaction's tip."""
        cfg = self.config
        if cfg is None or decision.kind != "delta" or self.running is not None or self.tip is not None:
            return False
        why = cfg.due(len(decision.chain) - 1, state.baseline_bytes, sum(state.delta_bytes))
        if why:
            log.info("save %d is the tip of the next compaction: %s", decision.ckpt_id, why)
            self.tip = decision.ckpt_id
        return bool(why)

    def wait(self) -> None:
        """Waits for this rank's part of the compaction in flight."""
        if self.running is not None:
            self.running.outcome()

    def drop(self, why: str) -> None:
        """Waits for the compaction in flight and forgets it, unfolded (``why``: a restore)."""
        comp, self.running, self.tip = self.running, None, None
        if comp is not None:
            out = comp.outcome()
            log.info("compaction %d %s before %s; it is not folded", comp.new_id, "committed" if out.ok else "failed",
                     why)

    def pinned(self) -> tuple[int, ...]:
        """What retention must keep besides its rule: the chain a compaction reads, and its result until folded."""
        comp = self.running
        return () if comp is None else comp.chain + (comp.new_id,)
