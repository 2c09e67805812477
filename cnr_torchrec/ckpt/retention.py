"""Retention: which committed checkpoints are kept, and garbage collection of the rest.

Rank 0 loads it once, when a Checkpointer opens the root, and then updates it in memory
with each commit, so committing checkpoint n costs the same whatever n is: one entry
added, the retention rule run over the kept entries (which retention bounds), index.json
rewritten, and whatever is no longer kept deleted. Entries hold what the rule needs and
no more: each checkpoint's link to its parent, its step and its bytes.

"Newest" is by commit, in the order restore tries checkpoints
(:func:`~cnr_torchrec.ckpt.format.commits.newest_state_first`), not by step: a job that goes on
from an older step writes the newest branch, which is kept, and the branch it left ages out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cnr_torchrec.ckpt.config import KeepConfig
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    ckpt_dir,
    committed_ids,
    load_manifest,
    manifest_path,
    newest_state_first,
    rank_file,
    remove_uncommitted,
    write_index,
)
from cnr_torchrec.ckpt.format.leases import read_leases
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["Catalog", "Entry", "Retention"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint, as retention sees it."""

    id: int
    step: int
    kind: str
    parent: int | None
    base: int
    nbytes: int
    world_size: int
    equals: int | None = None  # a compacted baseline: the checkpoint whose restore it reproduces
    files: tuple[str, ...] = ()  # every payload chunk of every rank

    @classmethod
    def of(cls, m: Manifest) -> Entry:
        return cls(id=m.id, step=m.step, kind=m.kind, parent=m.parent, base=m.base, nbytes=m.nbytes,
                   world_size=m.world_size, equals=m.equals, files=tuple(m.files))


class Catalog:
    """The committed checkpoints that are kept, by id (rank 0's, in memory)."""

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self.entries: dict[int, Entry] = {e.id: e for e in entries}

    @classmethod
    def load(cls, storage: Storage) -> Catalog:
        """Every committed checkpoint whose manifest loads. Once per Checkpointer: it reads every manifest.

        Manifests that do not load are left out, so they are never collected: they are
        ``cnr verify``'s and restore's business.
        """
        entries = []
        for i in committed_ids(storage):
            try:
                entries.append(Entry.of(load_manifest(storage, i)))
            except (CorruptCheckpointError, CheckpointNotFoundError, UnsafeCheckpointError) as e:
                log.warning("catalog: checkpoint %d is left alone (%s: %s)", i, type(e).__name__, e)
        return cls(entries)

    def add(self, manifest: Manifest) -> None:
        self.entries[manifest.id] = Entry.of(manifest)

    def needs(self, ids: Iterable[int]) -> set[int]:
        """``ids`` and every kept checkpoint their chains need, through parent links."""
        out: set[int] = set()
        for first in ids:
            i: int | None = first
            while i is not None and i not in out and i in self.entries:
                out.add(i)
                i = self.entries[i].parent
        return out

    def newest_first(self, leave_out: int | None = None) -> list[int]:
        """The kept ids, newest state first: by commit, as restore orders them (:func:`newest_state_first`).
        ``leave_out``: an id to order the others without."""
        ids = [i for i in self.entries if i != leave_out]
        return [e.id for e in newest_state_first(ids, self.entries.get)]

    def retained(self, keep: KeepConfig, pinned: Iterable[int] = ()) -> set[int]:
        """The ids ``keep`` keeps: the newest checkpoints (by count and bytes), the newest chains,
        and ``pinned`` (a compaction's source), each with what its chain needs.

        Newest is by commit, not by step (:meth:`newest_first`): a job that went on from an older
        step writes the newest branch, and the branch it left ages out. A chain is a baseline and
        everything on it; the newest chains are those whose newest checkpoints are newest.
        """
        order = self.newest_first()
        if not order:
            return set()
        kept = self.needs(order[:1])  # the newest, whatever the limits
        for n, i in enumerate(order[1:], start=2):
            if keep.checkpoints is not None and n > keep.checkpoints:
                break
            if keep.checkpoints is None and keep.bytes is None:
                break
            grown = kept | self.needs([i])
            if keep.bytes is not None and sum(self.entries[j].nbytes for j in grown) > keep.bytes:
                break
            kept = grown
        if keep.chains is not None:
            bases = list(dict.fromkeys(self.entries[i].base for i in order))[: keep.chains]  # by newest member
            kept |= self.needs(i for i, e in self.entries.items() if e.base in bases)
        return kept | self.needs(pinned)

    def branch_below(self, entry: Entry) -> int | None:
        """The highest step of the other kept checkpoints if ``entry`` starts a branch below it; else None.

        ``entry`` starts a branch when it does not go on from the newest of the others: its step is
        lower than the newest's (a job that restored an older step, fell back past corrupt
        checkpoints, or started afresh), or it is a delta whose parent is not on the newest's chain
        (a compacted baseline on it stands for the chain it folds). A compacted baseline is no branch
        (it has its tip's step), and neither are the deltas around a compaction. Only a branch's
        first checkpoint qualifies: from then on it is the newest.
        """
        others = self.newest_first(leave_out=entry.id)
        if entry.equals is not None or not others:
            return None
        top = max(self.entries[i].step for i in others)
        newest = self.entries[others[0]]
        if entry.step >= top:
            return None
        if entry.step < newest.step:
            return top
        parent = self.entries.get(entry.parent) if entry.parent is not None else None
        if parent is None:
            return None  # a baseline, or a parent retention no longer holds: nothing says it branched
        anchor = parent.equals if parent.equals is not None else parent.id  # a compaction stands for its tip
        return None if anchor in self._lineage(newest.id) else top

    def _lineage(self, i: int | None) -> set[int]:
        """``i`` and the kept checkpoints whose state it builds on: its chain, and through a compacted
        baseline the chain it folds."""
        out: set[int] = set()
        while i is not None and i not in out and i in self.entries:
            out.add(i)
            e = self.entries[i]
            i = e.parent if e.parent is not None else e.equals
        return out

    def collect(self, storage: Storage, keep: KeepConfig, pinned: Iterable[int] = ()) -> list[int]:
        """Drops what ``keep`` does not keep: index.json first, then each manifest (the uncommit), then
        its files. Returns the ids dropped."""
        kept = self.retained(keep, pinned)
        drop = sorted(set(self.entries) - kept)
        dropped = {i: self.entries.pop(i) for i in drop}
        self.write_index(storage)
        for i, e in dropped.items():
            storage.delete(manifest_path(i))
            storage.remove_dir(ckpt_dir(i), list(e.files) or [rank_file(i, r) for r in range(e.world_size)])
        return drop

    def write_index(self, storage: Storage) -> None:
        """index.json: the kept ids, which stores that cannot list read as the catalog."""
        write_index(storage, sorted(self.entries))


class Retention:
    """Rank 0's catalog, and the retention rule run after each commit.

    Saves and compactions commit on threads of their own, so every change goes through
    one lock. ``pinned()`` names what must stay besides the rule (a compaction's source), and so do the
    leases of the followers ``keep.followers`` names.
    """

    def __init__(self, keep: KeepConfig, pinned: Callable[[], Iterable[int]]) -> None:
        self.keep, self._pinned = keep, pinned
        self._catalog: Catalog | None = None
        self._lock = threading.Lock()

    def committed(self, manifest: Manifest, storage: Storage) -> None:
        """``manifest`` committed: the catalog takes it and what ``keep`` does not keep is deleted. Never raises
        (a commit must not fail for it); the next commit tries again.

        Logs a warning when ``manifest`` starts a branch below the highest step under the root
        (:meth:`Catalog.branch_below`): once per branch, at its first commit.
        """
        try:
            with self._lock:
                pinned = tuple(self._pinned())
                if self._catalog is None:
                    self._catalog = Catalog.load(storage)  # once per Checkpointer: it reads every manifest
                    stale = remove_uncommitted(storage, manifest.id, keep=pinned)
                    if stale:
                        log.info("removed the directories of saves that never committed: %s", stale)
                else:
                    self._catalog.add(manifest)
                top = self._catalog.branch_below(Entry.of(manifest))
                if top is not None:  # before collecting, which may fail: the branch's first commit is its only one
                    log.warning("checkpoint %d (step %d) starts a new branch below step %d, the highest step under the "
                                "root: retention keeps by commit, so it keeps this branch and collects the other one "
                                "as it ages out, and restore() with no step restores this branch", manifest.id,
                                manifest.step, top)
                drop = self._catalog.collect(storage, self.keep, pinned=pinned + self._leased(storage))
            if drop:
                log.info("garbage-collected checkpoints %s (%s)", drop, self.keep)
        except Exception as e:
            log.warning("after commit: could not update the index or collect garbage: %s: %s", type(e).__name__, e)

    def _leased(self, storage: Storage) -> tuple[int, ...]:
        """What the followers' leases keep (:mod:`~cnr_torchrec.ckpt.format.leases`): every checkpoint from the
        oldest one a named follower serves on."""
        if not self.keep.followers:
            return ()
        leases = read_leases(storage, self.keep.followers, self.keep.follower_max_age_s)
        if not leases:
            return ()
        assert self._catalog is not None  # loaded by the commit that asks
        oldest = min(leases.values())
        return tuple(i for i in self._catalog.entries if i >= oldest)
