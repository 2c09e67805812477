"""How a checkpoint's entries fit together: the checks that the schema's field-by-field ones cannot make.

Each entry holds a region of a table (rows x columns). The schema checks each entry alone (inside its
table, its blobs of the right shapes); these check them against each other and against the layout the
index records (:mod:`.placement`):

- no two entries of a table overlap, within a part or across a checkpoint's parts: a row stored twice is
  added twice in a residual chain, and which copy a plain one takes is arbitrary. A compacted baseline's merged
  blocks may overlap where the plan changed, each holding other rows of the region (only their row ids tell
  them apart, which the restore's own account checks): there, no two entries may name the same region;
- where the index records the ranks' shards, every entry of a part lies inside one of its own rank's shards
  (the data_parallel tables, which the shards leave out, on rank 0 alone), and a baseline's part covers
  each of them;
- a baseline covers every table: its entries and the tables it stores whole tile each one;
- the tables the index lists as replicated are the ones its parts store whole, and ``per_rank_state`` says
  whether every part holds its rank's RNG state.

:func:`check_part_layout` runs on every part as it is read (:func:`~.schema.check_part`); :func:`check_parts`
wherever every part of a checkpoint is at hand (``cnr verify``; a restore that reads them all).
Each violation is a :class:`~cnr_torchrec.errors.CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport, TableEntry
from cnr_torchrec.errors import CorruptCheckpointError

__all__ = ["check_part_layout", "check_parts"]

_Placed = tuple[TableEntry, int]
"""An entry and the rank whose part holds it."""


def _fail(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}. The checkpoint was edited or crafted; refusing it (restore "
                                  "another checkpoint with restore(step=...))", path=path)


def _where(table: str, e: TableEntry) -> str:
    return f"the entry of table '{table}' at rows {list(e.rows)}, columns {list(e.cols)}"


def _covers(entries: Sequence[TableEntry], rows: tuple[int, int], cols: tuple[int, int]) -> bool:
    """Whether the regions of ``entries`` together cover ``rows`` x ``cols``: in each column segment their
    bounds cut it into, the row ranges of the entries that span the segment leave no gap."""
    if rows[0] == rows[1]:
        return True
    cuts = sorted({cols[0], cols[1], *(c for e in entries for c in e.cols if cols[0] < c < cols[1])})
    for a, b in zip(cuts, cuts[1:]):
        reach = rows[0]
        for r0, r1 in sorted(e.rows for e in entries if e.cols[0] <= a and b <= e.cols[1]):
            if r0 > reach:
                break
            reach = max(reach, r1)
        if reach < rows[1]:
            return False
    return True


def _first_overlap(entries: Iterable[_Placed], *, merged: bool = False) -> tuple[_Placed, _Placed] | None:
    """Two of one table's ``entries`` whose regions overlap (or that name the same region), or None; with
    ``merged`` (a compacted baseline's), two that name the same region only.

    A sweep down the rows: each entry is compared with those still open at its first row."""
    prev: _Placed | None = None
    open_: list[_Placed] = []
    for placed in sorted(entries, key=lambda p: (p[0].rows, p[0].cols)):
        e = placed[0]
        if prev is not None and (prev[0].rows, prev[0].cols) == (e.rows, e.cols):  # sorted: the same region is next
            return prev, placed
        prev = placed
        if merged:
            continue
        open_ = [p for p in open_ if p[0].rows[1] > e.rows[0]]
        for p in open_:
            if p[0].cols[0] < e.cols[1] and e.cols[0] < p[0].cols[1]:
                return p, placed
        if e.rows[1] > e.rows[0]:
            open_.append(placed)
    return None


def _check_apart(tables: Mapping[str, Sequence[_Placed]], manifest: Manifest, path: str, across: str) -> None:
    merged = manifest.compacted_from is not None
    for table, entries in tables.items():
        pair = _first_overlap(entries, merged=merged)
        if pair is not None:
            (a, ra), (b, rb) = pair
            which = f" (in the parts of ranks {ra} and {rb})" if across and ra != rb else ""
            raise _fail(path, f"{_where(table, a)} and {_where(table, b)} overlap{which}: a row would be stored "
                              "twice")


def check_part_layout(report: RankReport, manifest: Manifest, path: str, boxes: Sequence[Sequence[Any]] | None) -> None:
    """Checks one part's entries against each other and, where the index records the ranks' shards (``boxes``:
    this rank's, by :func:`~.placement.rank_boxes`; None where it records none), against its rank's own: each
    entry inside one of them (data_parallel tables on rank 0 only), and a baseline's covering each of them.

    Raises:
        CorruptCheckpointError: two entries overlap, an entry lies outside its rank's shards, or a baseline's
            part leaves a shard of its rank uncovered; names ``path``.
    """
    _check_apart({t: [(e, report.rank) for e in es] for t, es in report.tables.items()}, manifest, path, across="")
    if boxes is None:
        return
    shards = manifest.body["shards"]
    by_table: dict[str, list[Sequence[Any]]] = {}
    for b in boxes:
        by_table.setdefault(b[0], []).append(b)
    for table, entries in report.tables.items():
        own = by_table.get(table, [])
        for e in entries:
            if table not in shards:
                if report.rank != 0:
                    raise _fail(path, f"{_where(table, e)} is on rank {report.rank}, but table '{table}' is not "
                                      "sharded (rank 0 stores it for every rank)")
            elif not any(_inside(e, b) for b in own):
                raise _fail(path, f"{_where(table, e)} lies outside rank {report.rank}'s shards of the table "
                                  f"({[b[1:] for b in own]}, as [rows..., columns...])")
    if manifest.kind != "baseline":
        return
    for box in boxes:
        table = box[0]
        inside = [e for e in report.tables.get(table, ()) if _inside(e, box)]
        if not _covers(inside, (box[1], box[2]), (box[3], box[4])):
            raise _fail(path, f"baseline {manifest.id} does not cover rank {report.rank}'s shard of table '{table}' "
                              f"(rows {box[1:3]}, columns {box[3:5]})")
    if report.rank == 0:
        _check_covered({t: [(e, 0) for e in es] for t, es in report.tables.items() if t not in shards},
                       set(report.replicated_tables), manifest, [t for t in manifest.tables if t not in shards], path)


def _inside(e: TableEntry, box: Sequence[Any]) -> bool:
    return box[1] <= e.rows[0] and e.rows[1] <= box[2] and box[3] <= e.cols[0] and e.cols[1] <= box[4]


def _check_covered(entries: Mapping[str, Sequence[_Placed]], whole: set[str], manifest: Manifest,
                   tables: Iterable[str], path: str) -> None:
    """A baseline's ``tables`` are each stored whole or tiled by their (non-overlapping) ``entries``."""
    for table in tables:
        n, dim = manifest.tables[table]
        if table not in whole and not _covers([e for e, _ in entries.get(table, ())], (0, n), (0, dim)):
            raise _fail(path, f"baseline {manifest.id} does not cover table '{table}' ({n} x {dim}) with its entries")


def check_parts(manifest: Manifest, reports: Sequence[RankReport]) -> None:
    """Checks every part of a checkpoint together (each passed :func:`check_part_layout` as it was read): no entry
    overlaps one of another part; a baseline covers every table; the index's ``replicated`` names exactly the
    tables the parts store whole, and its ``per_rank_state`` whether every part holds RNG state (format 7).

    Raises:
        CorruptCheckpointError: as said; names the manifest.
    """
    path = f"ckpt-{manifest.id:08d}/manifest.json"
    placed: dict[str, list[_Placed]] = {}
    for report in reports:
        for table, entries in report.tables.items():
            placed.setdefault(table, []).extend((e, report.rank) for e in entries)
    _check_apart(placed, manifest, path, across="parts")
    whole = [t for r in reports for t in r.replicated_tables]
    if len(set(whole)) != len(whole):
        raise _fail(path, f"two parts store the same replicated table whole ({sorted(whole)})")
    if manifest.kind == "baseline":
        _check_covered(placed, set(whole), manifest, manifest.tables, path)
    if manifest.version < 7:
        return
    if sorted(whole) != sorted(manifest.replicated):
        raise _fail(path, f"replicated lists {sorted(manifest.replicated)}, but the parts store {sorted(whole)} whole")
    has_state = all(r.rng is not None for r in reports)
    if manifest.per_rank_state != has_state:
        raise _fail(path, f"per_rank_state is {str(manifest.per_rank_state).lower()}, but "
                          f"{'every' if has_state else 'not every'} part holds its rank's RNG state")
