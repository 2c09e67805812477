"""Which checkpoint a restore takes: the newest committed one whose chain is sound (rank 0 decides).

It reads manifests and file sizes only; the ranks then apply the chain and agree on the
outcome (:meth:`cnr_torchrec.ckpt.Checkpointer.restore`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    check_files_inside,
    ckpt_id_of,
    committed_ids,
    load_manifest,
    manifest_path,
    newest_state_first,
    walk_chain,
)
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport
from cnr_torchrec.ckpt.restore.stats import timed
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["Pick", "resolve_chain"]

log = logging.getLogger(__name__)


def resolve_chain(
    storage: Storage, step: int | None, bad: dict[int, str], *, fail: bool, quiet: bool = False,
    stats: dict[str, float] | None = None, reads: Callable[[Manifest], Sequence[RankReport]] | None = None,
) -> tuple[Pick, list[Manifest] | None]:
    """The newest committed checkpoint (of ``step``) whose chain is sound, as far as manifests tell.

    Sound: every manifest of the chain loads, matches its checksum and passes the schema, its
    links (parent, base, depth) lead back to a baseline (:func:`walk_chain`), and every rank
    file lies in its checkpoint's directory, exists and has the size the manifest gives (with ``reads``, the
    reports this rank will read, by :func:`~cnr_torchrec.ckpt.format.placement.reports_for`: of a format 7
    checkpoint, only those parts and their files; another rank's are checked by the rank that reads them,
    and a problem found while applying fails the attempt on every rank, which then skips the checkpoint as
    here). Checkpoints in
    ``bad`` (and chains through them) are skipped; unless ``fail`` (``on_corrupt: fail``), corrupt ones found
    here are added to it.
    ``quiet``: do not log the skips (a rank whose pick only confirms rank 0's). ``stats``: adds the
    time spent reading and checking manifests (``manifests_ms``).

    Rank 0 calls it through :meth:`~cnr_torchrec.ckpt._collective.Ranks.from_rank0`, which
    raises what it raises on every rank.

    Returns:
        ``(Pick, manifests)`` for the pick; ``(Pick with an empty chain, None)`` when none is left.

    Raises:
        CorruptCheckpointError: under ``on_corrupt: fail``, a checkpoint it looks at is unsound
            (the catalog index.json included).
        UnsafeCheckpointError: a manifest names a file outside its checkpoint, or a dtype never written.
        Exception: whatever the storage raises while listing or reading (an S3 ``ClientError``,
            an ``OSError``); a storage error is no evidence of corruption, so nothing is skipped for it.
    """
    return _Resolver(storage, bad, fail, quiet, stats, reads).pick(step)


@dataclass(frozen=True)
class Pick:
    """The checkpoint a restore takes, as rank 0 chose it and every rank hears it.

    Attributes:
        chain: the ids to apply, baseline first; empty when no checkpoint is left to restore.
        skipped: ``(id, why)`` of each checkpoint found unsound on the way (each rank logs them).
    """

    chain: tuple[int, ...] = ()
    skipped: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"chain": list(self.chain), "skipped": [[i, why] for i, why in self.skipped]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Pick:
        return cls(tuple(int(i) for i in doc["chain"]), tuple((int(i), str(why)) for i, why in doc["skipped"]))


class _Through(Exception):
    """The chain needs a checkpoint already found unsound."""


class _Resolver:
    """One call of :func:`resolve_chain`: the manifests it loaded, and what it found unsound."""

    def __init__(self, storage: Storage, bad: dict[int, str], fail: bool, quiet: bool,
                 stats: dict[str, float] | None = None,
                 reads: Callable[[Manifest], Sequence[RankReport]] | None = None) -> None:
        self.storage, self.bad, self.fail, self.quiet, self.stats = storage, bad, fail, quiet, stats
        self.reads = reads or (lambda m: m.ranks)
        self.skipped: list[tuple[int, str]] = []  # (id, why) found unsound in this call, for the other ranks' logs
        self._loaded: dict[int, Manifest] = {}

    def pick(self, step: int | None) -> tuple[Pick, list[Manifest] | None]:
        for m in self._candidates():
            if step is not None and m.step != step:
                continue
            chain = self._sound_chain_or_skip(m)
            if chain is not None:
                return Pick(tuple(c.id for c in chain), tuple(self.skipped)), chain
        return Pick((), tuple(self.skipped)), None

    def _skip(self, cid: int, why: str) -> None:
        self.bad[cid] = why
        self.skipped.append((cid, why))
        if not self.quiet:
            log.warning("restore: skipping checkpoint %d: %s (on_corrupt: fallback)", cid, why)

    def _manifest(self, i: int) -> Manifest:
        if i not in self._loaded:
            with timed(self.stats, "manifests_ms"):
                self._loaded[i] = load_manifest(self.storage, i)
        return self._loaded[i]

    def _member(self, i: int) -> Manifest:
        if i in self.bad:
            raise _Through(i)
        return self._manifest(i)

    def _candidates(self) -> Iterator[Manifest]:
        """Committed manifests, newest state first (:func:`newest_state_first`: by commit, except that a
        compacted baseline comes right before the tip it reproduces), the unsound ones skipped."""
        ids = committed_ids(self.storage)  # CorruptCheckpointError for a corrupt index.json, on stores that cannot list
        return newest_state_first(ids, self._candidate)

    def _candidate(self, cid: int) -> Manifest | None:
        """``cid``'s manifest; None if it is known bad, collected since it was listed, or corrupt (then skipped)."""
        if cid in self.bad:
            return None
        try:
            return self._manifest(cid)
        except CheckpointNotFoundError:
            return None  # collected since it was listed
        except CorruptCheckpointError as e:
            if self.fail:
                raise
            self._skip(cid, str(e))
            return None

    def _sound_chain_or_skip(self, m: Manifest) -> list[Manifest] | None:
        """``m``'s chain if it is sound; else None, with the culprit skipped (or raised under ``fail``)."""
        cid = m.id
        try:
            chain = walk_chain(m, self._member)
            for c in chain:
                self._check_files(c)
            return chain
        except _Through as e:
            log.warning("restore: skipping checkpoint %d: its chain needs checkpoint %s, which failed its checks",
                        cid, e.args[0])
        except UnsafeCheckpointError:  # a ValueError, but refused, never skipped
            raise
        except CorruptCheckpointError as e:
            if self.fail:
                raise
            owner = ckpt_id_of(e.path)
            self._skip(owner if owner is not None else cid, str(e))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            err = CorruptCheckpointError(f"{manifest_path(cid)} (or a manifest of its chain) is malformed: "
                                         f"{type(e).__name__}: {e}", path=manifest_path(cid))
            if self.fail:
                raise err from e
            self._skip(cid, str(err))
        return None

    def _check_files(self, c: Manifest) -> None:
        check_files_inside(c)  # UnsafeCheckpointError for ../x, absolute paths and other checkpoints' files
        with timed(self.stats, "manifests_ms"):  # the parts this rank reads, checked as they load
            reports = list(self.reads(c))
        for r in reports:
            for chunk in r.payload.chunks:
                self._check_size(chunk.path, chunk.nbytes, c.id)

    def _check_size(self, rel: str, nbytes: int, cid: int) -> None:
        try:
            size = self.storage.size(rel)
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(f"{rel} is missing; checkpoint {cid} is committed and needs it",
                                         path=rel) from None
        if size is not None and size != nbytes:
            what = "truncated" if size < nbytes else "longer than written"
            raise CorruptCheckpointError(f"{rel} is {size} bytes, its manifest says {nbytes} ({what})", path=rel)
