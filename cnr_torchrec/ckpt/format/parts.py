"""Per-rank parts (format 7): each rank's report of a checkpoint in a file of its own, beside its payload.

A checkpoint's manifest is then a small index (:func:`~cnr_torchrec.ckpt.format.writing.manifest_body`):
the job's fields, the chain links, the tables, and one line per rank with its part's size and digest,
its payload's size and chunk count, and what listings need. Each rank writes its part before it tells
rank 0 that it is done (:func:`write_part`), so that rank 0 commits from those lines alone, and the
index's digest of each part, sealed with the index (and under the root's key, if it has one), vouches
for the part as a chunk's digest vouches for the chunk.

A reader asks for ``manifest.ranks[r]``; the part is read, checked against its digest, the schema
and the index's line (:func:`~cnr_torchrec.ckpt.format.schema.check_part`), and kept. A rank that restores
on the plan that saved reads its own part and rank 0's (the dense state); ``cnr verify`` reads them all.

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

import xxhash

from cnr_torchrec.ckpt.format.integrity import check_chunk, chunk_hasher, chunk_record
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport, part_path_of
from cnr_torchrec.ckpt.format.schema import check_part, check_report, part_digest
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["Box", "Parts", "checked_shards", "fits", "holders", "layout_digest", "part_bytes", "reports_for",
           "with_parts", "write_part"]


def part_bytes(ckpt_id: int, report: Mapping[str, Any]) -> bytes:
    """A rank's part of checkpoint ``ckpt_id``: its report (:func:`~cnr_torchrec.ckpt.format.writing.rank_report`)
    with the checkpoint's id, as compact JSON."""
    return json.dumps({"ckpt": ckpt_id, **report}, separators=(",", ":"), allow_nan=False).encode()


Box = list[Any]
"""A shard as JSON: ``[table, row_start, row_end, col_start, col_end]``."""


def layout_digest(boxes: Sequence[Box]) -> str:
    """A digest of a rank's boxes (``ckpt/layout.py``, ``shard_boxes``): the same on a plan that gives the rank
    the same shards. A rank whose digest is its line's in an index reads its own part for its rows."""
    return xxhash.xxh3_64_hexdigest(json.dumps([list(b) for b in boxes]).encode())


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
        self.shards_checked: Mapping[str, Any] | None = None  # the index's shards, once checked (checked_shards)
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
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt", path=path) \
                from None
        return check_part(raw, path, m)


def with_parts(manifest: Manifest, storage: Storage) -> Manifest:
    """``manifest`` with its rank reports: as they are for a format 6 manifest (which holds them), read on demand
    through ``storage`` for a format 7 index."""
    if manifest.version < 7:
        return manifest
    out = dataclasses.replace(manifest, ranks=())
    object.__setattr__(out, "ranks", Parts(storage, out))
    return out


def reports_for(manifest: Manifest, rank: int, boxes: Sequence[Box], data_parallel: bool) -> Sequence[RankReport]:
    """The reports of ``manifest`` that can hold rows of the shards this rank holds (``boxes``: its
    :func:`~cnr_torchrec.ckpt.layout.shard_boxes`; ``data_parallel``: whether it holds data_parallel tables too).

    An index records where the rows live (its lines' ``layout`` digests and its ``shards``) only where every
    rank's part holds the rows of its own shards and no other's (a save; a compaction whose merged blocks fit
    the plan), and rank 0 stores the data_parallel tables for everyone (whole, or as entries). So, on a format
    7 checkpoint that records them: on the plan that saved (this rank's line has its digest), the rank's own
    part; on another plan or world size, the parts of the ranks whose shards overlap this rank's; and rank 0's
    where the rank holds data_parallel tables or the checkpoint stores replicated tables. Else every part."""
    lines = manifest.summaries
    shards = manifest.body.get("shards")
    if manifest.version < 7 or not lines or any(line.layout is None for line in lines) or shards is None:
        return manifest.ranks
    if rank < len(lines) and lines[rank].layout == layout_digest(boxes):
        ranks = {rank}
    else:
        checked = checked_shards(manifest)
        ranks = {r for t, r0, r1, c0, c1 in boxes for r in holders(checked.get(t), (r0, r1), (c0, c1))}
    if data_parallel or manifest.replicated:
        ranks.add(0)
    return [manifest.ranks[r] for r in sorted(ranks)]


def checked_shards(manifest: Manifest) -> Mapping[str, Any]:
    """The index's ``shards``, once each rank's boxes it implies digest to that rank's line (so a crafted or
    damaged entry is refused before it steers a read). Checked once per manifest.

    Raises:
        CorruptCheckpointError: a malformed entry, or boxes that are not the ones the ranks recorded.
    """
    parts = manifest.ranks
    cached = getattr(parts, "shards_checked", None)
    if cached is not None:
        return cached
    path, shards = f"ckpt-{manifest.id:08d}/manifest.json", manifest.body["shards"]
    per_rank: list[list[Box]] = [[] for _ in manifest.summaries]
    try:
        for t, layout in shards.items():
            n, dim = manifest.tables[t]
            if isinstance(layout, dict):
                block = int(layout["rows"])
                if block < 1 or -(-n // block) > len(per_rank):
                    raise ValueError(f"a block of {block} rows does not fit {n} rows on {len(per_rank)} ranks")
                for r in range(-(-n // block)):
                    per_rank[r].append([t, r * block, min((r + 1) * block, n), 0, dim])
                continue
            for r, a, b, c, d in layout:
                if not (0 <= a <= b <= n and 0 <= c <= d <= dim):
                    raise ValueError(f"[{r}, {a}, {b}, {c}, {d}] lies outside the table ({n} x {dim})")
                per_rank[r].append([t, a, b, c, d])
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptCheckpointError(f"{path}: shards is malformed ({type(e).__name__}: {e}); the manifest was "
                                     "edited or crafted", path=path) from None
    for r, boxes in enumerate(per_rank):
        if layout_digest(sorted(boxes)) != manifest.summaries[r].layout:
            raise CorruptCheckpointError(f"{path}: shards does not give rank {r} the shards its line records; the "
                                         "manifest was edited or crafted", path=path)
    if isinstance(parts, Parts):
        parts.shards_checked = shards
    return shards


def holders(layout: Any, rows: tuple[int, int], cols: tuple[int, int]) -> set[int]:
    """The ranks whose shards of a table overlap ``rows`` x ``cols``, by the table's entry in an index's
    ``shards`` (:func:`~cnr_torchrec.ckpt.format.writing.shards_of`); none for a table it does not list."""
    if isinstance(layout, dict):
        block = layout["rows"]
        return set(range(rows[0] // block, -(-rows[1] // block))) if rows[1] > rows[0] else set()
    return {r for r, a, b, c, d in layout or () if a < rows[1] and rows[0] < b and c < cols[1] and cols[0] < d}


def fits(report: Mapping[str, Any], boxes: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> bool:
    """Whether every entry of ``report`` lies inside one of ``boxes`` (table, rows, columns): the part holds the
    rows of those shards and no other rank's (a lossless merge across a plan change may keep blocks wider)."""
    def inside(table: str, e: Mapping[str, Any]) -> bool:
        return any(t == table and r[0] <= e["rows"][0] and e["rows"][1] <= r[1] and c[0] <= e["cols"][0]
                   and e["cols"][1] <= c[1] for t, r, c in boxes)
    return all(inside(t, e) for t, es in report.get("tables", {}).items() for e in es)
