"""Where a format 7 checkpoint's rows live, and which ranks' parts a restoring rank reads (format/parts.py).

Each line of an index carries a digest of the shards its rank held (``layout``), and the index lists
the shards themselves (``shards``: a rule for a table split by rows into even blocks, one per rank in rank
order; a list otherwise). Both are recorded only where every rank's part holds the rows of its own shards
and of no other rank's; rank 0 stores the data_parallel tables for everyone. A rank then reads, of each
member of its chain: on the plan that saved, its own part; on another plan or world size, the parts of the
ranks whose shards overlap its own; rank 0's where it holds data_parallel tables; every part where the
index records neither.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport
from cnr_torchrec.ckpt.format.structure import check_parts
from cnr_torchrec.errors import CorruptCheckpointError

__all__ = ["Box", "checked_boxes", "checked_shards", "every_part", "fits", "holders", "layout_digest", "rank_boxes",
           "records_layout", "reports_for"]

Box = list[Any]
"""A shard as JSON: ``[table, row_start, row_end, col_start, col_end]``."""


def layout_digest(boxes: Sequence[Box]) -> str:
    """A digest of a rank's boxes (``ckpt/layout.py``, ``shard_boxes``): the same on a plan that gives the rank
    the same shards. A rank whose digest is its line's in an index reads its own part for its rows."""
    return xxhash.xxh3_64_hexdigest(json.dumps([list(b) for b in boxes]).encode())



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
    if not records_layout(manifest):
        return every_part(manifest)
    if rank < len(lines) and lines[rank].layout == layout_digest(boxes):
        ranks = {rank}
    else:
        checked = checked_shards(manifest)
        ranks = {r for t, r0, r1, c0, c1 in boxes for r in holders(checked.get(t), (r0, r1), (c0, c1))}
    if data_parallel or manifest.replicated:
        ranks.add(0)
    return [manifest.ranks[r] for r in sorted(ranks)]


def records_layout(manifest: Manifest) -> bool:
    """Whether ``manifest`` records where its rows live: a format 7 index whose lines all carry their rank's
    ``layout`` digest and which lists the ``shards``."""
    lines = manifest.summaries
    return (manifest.version >= 7 and bool(lines) and all(line.layout is not None for line in lines)
            and manifest.body.get("shards") is not None)


def every_part(manifest: Manifest) -> Sequence[RankReport]:
    """All of ``manifest``'s reports, checked together (:func:`~.structure.check_parts`) once per manifest."""
    parts = manifest.ranks
    if not getattr(parts, "checked_together", False):
        check_parts(manifest, list(parts))
        if hasattr(parts, "checked_together"):
            parts.checked_together = True
    return parts


def checked_shards(manifest: Manifest) -> Mapping[str, Any]:
    """The index's ``shards``, once each rank's boxes it implies digest to that rank's line (so a crafted or
    damaged entry is refused before it steers a read). Checked once per manifest.

    Raises:
        CorruptCheckpointError: a malformed entry, or boxes that are not the ones the ranks recorded.
    """
    checked_boxes(manifest)
    return manifest.body["shards"]


def checked_boxes(manifest: Manifest) -> Sequence[Sequence[Box]]:
    """Each rank's boxes by the index's ``shards`` (sorted, as :func:`layout_digest` takes them), once they digest
    to the ranks' lines. Checked once per manifest.

    Raises:
        CorruptCheckpointError: as :func:`checked_shards`.
    """
    parts = manifest.ranks
    cached = getattr(parts, "boxes_checked", None)
    if cached is None:
        cached = [_checked(manifest, r, boxes) for r, boxes in enumerate(_boxes(manifest, None))]
        if hasattr(parts, "boxes_checked"):
            parts.boxes_checked = cached
    return cached


def rank_boxes(manifest: Manifest, rank: int) -> Sequence[Box]:
    """Rank ``rank``'s boxes by the index's ``shards``, once they digest to its line: what a reader of the rank's
    own part needs, without every other rank's (cheap at any world size). Checked once per rank and manifest.

    Raises:
        CorruptCheckpointError: as :func:`checked_shards`, for this rank.
    """
    parts = manifest.ranks
    every = getattr(parts, "boxes_checked", None)
    if every is not None:
        return every[rank]
    cache = getattr(parts, "rank_boxes", None)
    if cache is not None and rank in cache:
        return cache[rank]
    (boxes,) = _boxes(manifest, rank)
    out = _checked(manifest, rank, boxes)
    if cache is not None:
        cache[rank] = out
    return out


def _boxes(manifest: Manifest, only: int | None) -> list[list[Box]]:
    """The boxes the index's ``shards`` give each rank (``only``: that rank's alone), every entry checked."""
    path, shards = f"ckpt-{manifest.id:08d}/manifest.json", manifest.body["shards"]
    ranks = len(manifest.summaries)
    per_rank: list[list[Box]] = [[] for _ in (range(ranks) if only is None else (only,))]

    def add(r: int, box: Box) -> None:
        if only is None:
            per_rank[r].append(box)
        elif r == only:
            per_rank[0].append(box)

    try:
        for t, layout in shards.items():
            n, dim = manifest.tables[t]
            if isinstance(layout, dict):
                block = int(layout["rows"])
                if block < 1 or -(-n // block) > ranks:
                    raise ValueError(f"a block of {block} rows does not fit {n} rows on {ranks} ranks")
                for r in range(-(-n // block)) if only is None else [only] if only < -(-n // block) else []:
                    add(r, [t, r * block, min((r + 1) * block, n), 0, dim])
                continue
            for r, a, b, c, d in layout:
                if not (0 <= a <= b <= n and 0 <= c <= d <= dim and 0 <= r < ranks):
                    raise ValueError(f"[{r}, {a}, {b}, {c}, {d}] lies outside the table ({n} x {dim}) or the ranks")
                add(r, [t, a, b, c, d])
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptCheckpointError(f"{path}: shards is malformed ({type(e).__name__}: {e}); the manifest was "
                                     "edited or crafted", path=path) from None
    return [sorted(boxes) for boxes in per_rank]


def _checked(manifest: Manifest, rank: int, boxes: list[Box]) -> list[Box]:
    if layout_digest(boxes) != manifest.summaries[rank].layout:
        path = f"ckpt-{manifest.id:08d}/manifest.json"
        raise CorruptCheckpointError(f"{path}: shards does not give rank {rank} the shards its line records; the "
                                     "manifest was edited or crafted", path=path)
    return boxes


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
