"""Per-rank parts (format 7): each rank's report of a checkpoint in a file of its own, beside its payload.

A checkpoint's manifest is then a small index (:func:`~cnr_torchrec.ckpt.format.writing.manifest_body`):
the job's fields, the chain links, the tables, and one line per rank with its part's size and digest,
its payload's size and chunk count, and what listings need. Each rank writes its part before it tells
rank 0 that it is done (:func:`write_part`), so that rank 0 commits from those lines alone, and the
index's digest of each part, sealed with the index (and under the root's key, if it has one), vouches
for the part as a chunk's digest vouches for the chunk.

A reader asks for ``manifest.ranks[r]``; the part is read, checked against its digest, the schema
and the index's line (:func:`~cnr_torchrec.ckpt.format.schema.check_part`), and kept. Which parts a
restoring rank asks for is :mod:`~cnr_torchrec.ckpt.format.placement`'s; ``cnr verify`` reads them all.

Layout::

    ckpt-00000007/rank-00003.bin    rank 3's payload, chunk 0 (chunks 1.. as rank-00003.<k>.bin)
    ckpt-00000007/rank-00003.json   rank 3's part: its report, compact JSON
    ckpt-00000007/manifest.json     the index, written last by rank 0: the commit
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

from cnr_torchrec.ckpt.format.bytes.integrity import check_chunk, chunk_hasher, chunk_record
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport, part_path_of
from cnr_torchrec.ckpt.format.placement import Box, layout_digest
from cnr_torchrec.ckpt.format.schema import check_part, check_report, parse_json, part_digest
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["Parts", "expand_part", "part_bytes", "with_parts", "write_part"]


# What an entry's codec description holds of its own; the rest is the same for every entry of a part.
_OWN_META = ("dim", "num_rows")


def part_bytes(ckpt_id: int, report: Mapping[str, Any]) -> bytes:
    """A rank's part of checkpoint ``ckpt_id``: its report (:func:`~cnr_torchrec.ckpt.format.writing.rank_report`)
    with the checkpoint's id, as compact JSON. The codec's description that every entry repeats (format,
    method, bits, parameters) is said once, as the part's ``meta``; each entry keeps its ``dim`` and
    ``num_rows`` (:func:`expand_part` puts it back)."""
    out = {"ckpt": ckpt_id, **report}
    entries = [e for es in report.get("tables", {}).values() for e in es if "weights" in e]
    shared = [{k: v for k, v in e["weights"]["meta"].items() if k not in _OWN_META} for e in entries]
    if shared and all(s == shared[0] for s in shared):
        out["meta"] = shared[0]
        out["tables"] = {t: [_own_meta(e) for e in es] for t, es in report["tables"].items()}
    return json.dumps(out, separators=(",", ":"), allow_nan=False).encode()


def _own_meta(entry: Mapping[str, Any]) -> dict[str, Any]:
    if "weights" not in entry:
        return dict(entry)
    meta = {k: v for k, v in entry["weights"]["meta"].items() if k in _OWN_META}
    return {**entry, "weights": {**entry["weights"], "meta": meta}}


def expand_part(raw: Any) -> Any:
    """A part as its report reads: the part's ``meta`` (if it says one) laid under each entry's own codec fields.
    Anything malformed is passed on as it is, for the schema to name."""
    if not isinstance(raw, dict) or "meta" not in raw:
        return raw
    raw = dict(raw)
    shared = raw.pop("meta")
    tables = raw.get("tables")
    if not isinstance(shared, dict) or not isinstance(tables, dict):
        raw["meta"] = shared  # left as it is: the entries then lack their codec's fields, which the schema names
        return raw
    raw["tables"] = {t: [_with_meta(e, shared) for e in es] if isinstance(es, list) else es
                     for t, es in tables.items()}
    return raw


def _with_meta(entry: Any, shared: Mapping[str, Any]) -> Any:
    weights = entry.get("weights") if isinstance(entry, dict) else None
    if not isinstance(weights, dict) or not isinstance(weights.get("meta"), dict):
        return entry
    return {**entry, "weights": {**weights, "meta": {**shared, **weights["meta"]}}}


def write_part(storage: Storage, ckpt_id: int, report: Mapping[str, Any],
               boxes: Sequence[Box] | None = None) -> dict[str, Any]:
    """Writes ``report`` as its rank's part of checkpoint ``ckpt_id``, durably, and returns the rank's line for
    the index, with what rank 0 needs to build the rest of it (the shapes of the rank's tables, the tables it
    stores whole, whether it saved per-rank state). A report that failed (``ok`` false) is passed on as it is.

    ``boxes``: the rank's shards (``ckpt/layout.py``, ``shard_boxes``) when the part holds the rows of those
    shards and of no other rank's (a save, a background compaction whose blocks fit); the line then carries
    their digest, and rank 0 the boxes themselves into the index's ``shards``. None where it does not say (an
    import, ``cnr compact``), whose readers then look at every part.
    """
    if not report.get("ok"):
        return dict(report)
    path = part_path_of(ckpt_id, report["rank"])
    check_report(report, path)
    data = part_bytes(ckpt_id, report)
    storage.write(path, data)
    storage.fsync_file(path)
    digest = chunk_hasher(storage.key)
    digest.update(data)
    line = chunk_record(storage.key, len(data), digest.hexdigest())
    line.update(payload=report["nbytes"], chunks=len(report.get("chunks") or [None]),
                rows_written=report["rows_written"], stall_ms=report["stall_ms"], write_ms=report["write_ms"],
                tbe_iter=report["tbe_iter"])
    out = {"rank": report["rank"], "ok": True, "line": line, "table_shapes": dict(report["table_shapes"]),
           "replicated": sorted(report["replicated_tables"]), "rng": report.get("rng") is not None}
    if boxes is not None:
        line["layout"] = layout_digest(boxes)
        out["boxes"] = [list(b) for b in boxes]
    return out


class Parts(Sequence[RankReport]):
    """The rank reports of a format 7 checkpoint, each read and checked the first time it is asked for.

    Reads go through the storage the index was loaded with while it is open, and through a storage of their own
    on the same root once it is closed (a manifest outlives the tool that loaded it). A lock keeps two threads
    from reading at once.
    """

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self._storage, self._manifest = storage, manifest
        self._own: Storage | None = None
        self.boxes_checked: Sequence[Sequence[Any]] | None = None  # each rank's shards, once checked (placement.py)
        self.rank_boxes: dict[int, Sequence[Any]] = {}  # some ranks' shards, once checked (placement.py)
        self.checked_together = False  # every part checked against the others (structure.py's check_parts)
        self._loaded: dict[int, RankReport] = {}
        self._lock = threading.Lock()

    def _reader(self) -> Storage:
        if not self._storage.closed:
            return self._storage
        if self._own is None:
            self._own = self._storage.reopen()
            weakref.finalize(self, self._own.close)
        return self._own

    def __len__(self) -> int:
        return len(self._manifest.summaries)

    @overload
    def __getitem__(self, r: int) -> RankReport: ...

    @overload
    def __getitem__(self, r: slice) -> Sequence[RankReport]: ...

    def __getitem__(self, r: int | slice) -> RankReport | Sequence[RankReport]:
        if isinstance(r, slice):
            return [self[i] for i in range(len(self))[r]]
        if r < 0:
            r += len(self)
        if not 0 <= r < len(self):
            raise IndexError(f"checkpoint {self._manifest.id} has {len(self)} ranks, not rank {r}")
        with self._lock:
            if r not in self._loaded:
                self._loaded[r] = self._read(r)
            return self._loaded[r]

    def __iter__(self) -> Iterator[RankReport]:
        return (self[r] for r in range(len(self)))

    @property
    def read(self) -> list[int]:
        """The ranks whose parts have been read so far."""
        return sorted(self._loaded)

    def _read(self, r: int) -> RankReport:
        m = self._manifest
        path = part_path_of(m.id, r)
        storage = self._reader()
        try:
            data = storage.read(path)
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing; checkpoint {m.id} is committed and needs it",
                                         path=path) from None
        digest, keyed = part_digest(m.body["parts"][r])
        check_chunk(storage.key, path, data, m.body["parts"][r]["nbytes"], digest, keyed)
        return check_part(expand_part(parse_json(data, path)), path, m, r)


def with_parts(manifest: Manifest, storage: Storage) -> Manifest:
    """``manifest`` with its rank reports: as they are for a format 6 manifest (which holds them), read on demand
    through ``storage`` for a format 7 index."""
    if manifest.version < 7:
        return manifest
    out = dataclasses.replace(manifest, ranks=())
    object.__setattr__(out, "ranks", Parts(storage, out))
    return out
