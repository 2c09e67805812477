"""Retention: which committed checkpoints are kept, and garbage collection of the rest.

Rank 0 loads it once, when a Checkpointer opens the root, and then updates it in memory
with each commit, so committing checkpoint n costs the same whatever n is: one entry
added, the retention rule run over the kept entries (which retention bounds), index.json
rewritten, and whatever is no longer kept deleted. Entries hold what the rule needs and
no more: each checkpoint's link to its parent, its step and its bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cnr_torchrec.ckpt.config import KeepConfig
from cnr_torchrec.ckpt.format.commits import (
    ckpt_dir,
    committed_ids,
    load_manifest,
    manifest_path,
    rank_file,
    remove_uncommitted,
    write_index,
)
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["Catalog", "Entry", "Retention"]

log = logging.getLogger("cnr_torchrec.ckpt.checkpointer")  # part of the Checkpointer's log


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
        for i in ids:
            while i is not None and i not in out and i in self.entries:
                out.add(i)
                i = self.entries[i].parent
        return out

    def retained(self, keep: KeepConfig, pinned: Iterable[int] = ()) -> set[int]:
        """The ids ``keep`` keeps: the newest checkpoints (by count and bytes), the newest chains,
        and ``pinned`` (a compaction's source), each with what its chain needs."""
        # Newest by step: a compacted baseline has its tip's step and a higher id than the deltas after the tip.
        newest_first = sorted(self.entries, key=lambda i: (self.entries[i].step, i), reverse=True)
        if not newest_first:
            return set()
        kept = self.needs(newest_first[:1])  # the newest, whatever the limits
        for n, i in enumerate(newest_first[1:], start=2):
            if keep.checkpoints is not None and n > keep.checkpoints:
                break
            if keep.checkpoints is None and keep.bytes is None:
                break
            grown = kept | self.needs([i])
            if keep.bytes is not None and sum(self.entries[j].nbytes for j in grown) > keep.bytes:
                break
            kept = grown
        if keep.chains is not None:
            bases = sorted({e.base for e in self.entries.values()}, reverse=True)[: keep.chains]
            kept |= self.needs(i for i, e in self.entries.items() if e.base in bases)
        return kept | self.needs(pinned)

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
    one lock. ``pinned()`` names what must stay besides the rule (a compaction's source).
    """

    def __init__(self, keep: KeepConfig, pinned: Callable[[], Iterable[int]]) -> None:
        self.keep, self._pinned = keep, pinned
        self._catalog: Catalog | None = None
        self._lock = threading.Lock()

    def committed(self, manifest: Manifest, storage: Storage) -> None:
        """``manifest`` committed: the catalog takes it and what ``keep`` does not keep is deleted. Never raises
        (a commit must not fail for it); the next commit tries again."""
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
                drop = self._catalog.collect(storage, self.keep, pinned=pinned)
            if drop:
                log.info("garbage-collected checkpoints %s (%s)", drop, self.keep)
        except Exception as e:
            log.warning("after commit: could not update the index or collect garbage: %s: %s", type(e).__name__, e)
