"""The manifest as types: what a committed checkpoint holds, read by attribute.

A manifest body is JSON on disk (:mod:`~cnr_torchrec.ckpt.format.commits` seals and loads
it). It becomes a :class:`Manifest` in one place, the schema check
(:func:`~cnr_torchrec.ckpt.format.schema.check_manifest`), which builds these classes as it
checks each field. So everything past the check can trust what it reads: a :class:`Blob` lies
inside its payload and matches its dtype and shape, a :class:`TableEntry` lies inside its
table, and every name an entry gives is a blob its report describes.

The classes are frozen; their mappings are read-only views. The writers build JSON, not
these classes: a save's body is checked, and so typed, before it is sealed.

Nesting, outermost first::

    Manifest            one checkpoint: chain links, tables, job-level fields
      RankSummary       what the index says of each rank
      RankReport        one rank's part: its payload, entries, dense and per-rank state
        Payload         the rank's bytes: chunk files and the blobs inside them
          Chunk, Blob
        TableEntry      one shard's rows of one table: row ids, encoded weights, optimizer states,
                        managed-collision state
          RowIds, Weights, StateRef, McRows
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "Blob",
    "Chunk",
    "Manifest",
    "McRows",
    "Payload",
    "RankReport",
    "RankSummary",
    "RowIds",
    "RowModes",
    "StateRef",
    "TableEntry",
    "Weights",
    "chunk_path",
    "frozen",
    "part_path_of",
    "rank_file_of",
]


def frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only view of a copy of ``mapping``."""
    return MappingProxyType(dict(mapping))


_EMPTY: Mapping[str, Any] = MappingProxyType({})


def rank_file_of(ckpt_id: int, rank: int) -> str:
    """A rank's payload file (its chunk 0) in checkpoint ``ckpt_id``."""
    return f"ckpt-{ckpt_id:08d}/rank-{rank:05d}.bin"


def part_path_of(ckpt_id: int, rank: int) -> str:
    """A rank's part of checkpoint ``ckpt_id`` (format 7): its report, as JSON."""
    return f"ckpt-{ckpt_id:08d}/rank-{rank:05d}.json"


def chunk_path(file: str, k: int) -> str:
    """Chunk ``k``'s path: ``file`` itself for chunk 0, ``<stem>.<k>.bin`` after it."""
    return file if k == 0 else f"{file.removesuffix('.bin')}.{k}.bin"


@dataclass(frozen=True)
class Chunk:
    """One object of a payload: bytes ``[start, start + nbytes)`` of the stream, and their digest: xxh3, or a
    keyed BLAKE2b (``keyed``) on a root with a key (:mod:`~cnr_torchrec.ckpt.format.bytes.integrity`)."""

    path: str
    start: int
    nbytes: int
    digest: str
    keyed: bool = False

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class Blob:
    """One tensor of a payload: raw bytes ``[offset, offset + nbytes)`` of ``dtype`` and ``shape``."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    xxh3: str

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Payload:
    """A rank's bytes: one logical stream of ``nbytes``, stored as ``chunks``, holding ``blobs`` by name.

    ``file`` is chunk 0's path; a report older than chunking (format 3) is one chunk.
    """

    file: str
    nbytes: int
    chunks: tuple[Chunk, ...]
    blobs: Mapping[str, Blob]
    chunk_bytes: int | None = None  # None: unchunked (format 3)

    @property
    def files(self) -> list[str]:
        """Every object the payload occupies."""
        return [c.path for c in self.chunks]


@dataclass(frozen=True)
class RowIds:
    """Which rows of its range an entry stores: ``count`` row offsets, packed as a ``bitmap`` or a ``list``."""

    kind: str
    count: int
    blob: str


@dataclass(frozen=True)
class Weights:
    """An entry's encoded rows: the codec's metadata (:meth:`~cnr_torchrec.quant.EncodedRows.metadata`)
    and, for each tensor the codec writes, the blob that holds it."""

    meta: Mapping[str, Any]
    blobs: Mapping[str, str]


@dataclass(frozen=True)
class StateRef:
    """One optimizer state of an entry's rows: one value per row (``rowwise``), or one per row and column."""

    rowwise: bool
    blob: str


@dataclass(frozen=True)
class McRows:
    """The managed-collision (sort-zch) state of an entry's rows: int64 ``[rows, len(fields)]``, by table row.

    ``fields`` names the columns: ``raw_id`` (int64's max for an empty slot), then the eviction
    policy's metadata (``counts``, ``last_access_iter``) as the module names it.
    """

    blob: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class RowModes:
    """Which stored rows of a residual entry are stored whole (format 6): ``count`` of them, marked in the
    packed bitmap in blob ``blob`` (:func:`~cnr_torchrec.ckpt.format.row_ids.stored_modes`)."""

    count: int
    blob: str


@dataclass(frozen=True)
class RowChecks:
    """One CRC-32C (int32, in blob ``blob``) for each group of ``rows`` stored rows of an entry, the last
    group shorter when the rows do not divide evenly."""

    blob: str
    rows: int


@dataclass(frozen=True)
class TableEntry:
    """The rows one shard stored of one table: global ``rows`` x ``cols`` ranges, half open.

    Without ``ids`` the entry stores every row of its range, in order. ``checks`` (format 5):
    the CRC-32Cs of its stored rows, by groups (:mod:`~cnr_torchrec.ckpt.format.bytes.rows`). ``mc``: the
    rows' managed-collision state, for a sort-zch table. A ``residual`` entry
    adds to the rows the chain restored before it (``quantization.residual``), except the rows its ``whole``
    bitmap marks (format 6), which it stores whole, as a plain entry does. ``replicated``
    is never stored: it names the blob of a whole float32 table (a data_parallel table, which
    rank 0 stores whole), which restore reads as an entry spanning the table.
    """

    rows: tuple[int, int]
    cols: tuple[int, int]
    encoding: str
    weights: Weights | None
    ids: RowIds | None = None
    states: tuple[StateRef, ...] = ()
    residual: bool = False
    replicated: str | None = None
    checks: RowChecks | None = None
    mc: McRows | None = None
    whole: RowModes | None = None

    @property
    def row_blobs(self) -> list[str]:
        """The blobs holding one record per stored row, in the order the row's part of its group's CRC-32C
        covers them: the encoded rows' tensors by field name (or the replicated table), then the optimizer
        states, then the managed-collision state."""
        if self.replicated is not None:
            return [self.replicated]
        mc = [self.mc.blob] if self.mc is not None else []
        return [self.coded.blobs[k] for k in sorted(self.coded.blobs)] + [s.blob for s in self.states] + mc

    @property
    def coded(self) -> Weights:
        """The encoded rows' blobs and codec description, which every entry but a replicated table's has (the
        schema checks it)."""
        if self.weights is None:
            raise ValueError(f"an entry of replicated table blob {self.replicated!r} stores no encoded rows")
        return self.weights

    @property
    def row_checks(self) -> RowChecks:
        """The CRC-32Cs of the stored rows (format 5 and later; older entries are read whole)."""
        if self.checks is None:
            raise ValueError("an entry written before format 5 has no row checks; it is read whole")
        return self.checks

    @property
    def mc_rows(self) -> McRows:
        """A managed-collision table's by-row state (its blob and fields)."""
        if self.mc is None:
            raise ValueError("this entry holds no managed-collision state")
        return self.mc

    @property
    def num_rows(self) -> int:
        """Rows in the entry's range."""
        return self.rows[1] - self.rows[0]

    @property
    def num_stored(self) -> int:
        """Rows the entry stores."""
        return self.ids.count if self.ids is not None else self.num_rows


@dataclass(frozen=True)
class RankReport:
    """One rank's part of a checkpoint.

    Attributes:
        tables: the entries this rank wrote, by table.
        replicated_tables: data_parallel tables stored whole (rank 0 only), by table: blob names.
        dense: dense parameters and buffers, by name: blob names (rank 0 holds them; others may).
        table_shapes: the global shape of each table this rank holds.
        dense_optimizer, rng, extra: flattened state trees
            (:func:`~cnr_torchrec.ckpt.format.bytes.payload.flatten_state`); ``extra`` by name.
        mc_runtime: per managed-collision table this rank holds, its module's eviction window
            and iteration counters (:meth:`~cnr_torchrec.track.managed_collision.McTable.runtime`),
            as flattened state trees.
    """

    rank: int
    payload: Payload
    tables: Mapping[str, tuple[TableEntry, ...]]
    replicated_tables: Mapping[str, str]
    dense: Mapping[str, str]
    tbe_iter: int
    table_shapes: Mapping[str, Any]
    rows_written: int
    stall_ms: float
    write_ms: float
    dense_optimizer: Any = None
    rng: Any = None
    extra: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    mc_runtime: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    @property
    def file(self) -> str:
        return self.payload.file

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes

    @property
    def blobs(self) -> Mapping[str, Blob]:
        return self.payload.blobs

    def entries(self) -> list[tuple[str, TableEntry]]:
        """Every (table, entry) this rank wrote."""
        return [(t, e) for t, es in self.tables.items() for e in es]


@dataclass(frozen=True)
class RankSummary:
    """What a checkpoint's index says of one rank (format 7), or its report (older formats): enough for a
    listing, a commit's outcome and the chain's step counter, without the rank's entries.

    Attributes:
        nbytes: the rank's payload bytes; chunks: how many objects hold them.
        tbe_iter: the highest TBE iteration counter of the rank's tables.
    """

    rank: int
    nbytes: int
    chunks: int
    rows_written: int
    stall_ms: float
    write_ms: float
    tbe_iter: int
    layout: str | None = None  # the shards it held, as a digest (format 7 parts of a save; see format/parts.py)


@dataclass(frozen=True)
class Manifest:
    """One committed checkpoint.

    A baseline is its own ``base`` at ``depth`` 0 with no ``parent``; a delta applies on
    ``parent`` (one ``depth`` less, same ``base``). ``since`` says what a delta's rows
    changed since: the ``"baseline"`` or the ``"previous"`` checkpoint. A compacted baseline
    ``equals`` the checkpoint whose restore it reproduces and names the chain it folds in
    ``compacted_from``.

    ``body`` is the JSON the manifest was built from, for tools that print it or copy fields.

    Since format 7 the manifest is an index: each rank's report is a part of its own, read and checked when
    ``ranks[r]`` is first asked for (:class:`~cnr_torchrec.ckpt.format.parts.Parts`), so that a rank that
    restores on the plan that saved reads its own part and rank 0's (the dense state) and no other.
    ``summaries`` says what listings need of every rank without reading any part.
    """

    id: int
    step: int
    kind: str
    parent: int | None
    base: int
    depth: int
    since: str | None
    reason: str
    policy: str | None
    world_size: int
    codec: Mapping[str, Any]
    restores: int
    tables: Mapping[str, tuple[int, int]]
    table_fqns: Mapping[str, Any]
    replicated: tuple[str, ...]
    encodings: Mapping[str, str]
    nbytes: int
    created_unix: float
    ranks: Sequence[RankReport]
    summaries: tuple[RankSummary, ...] = ()
    version: int = 7
    equals: int | None = None
    compacted_from: tuple[int, ...] | None = None
    per_rank_state: bool = True
    body: Mapping[str, Any] = field(default_factory=lambda: _EMPTY, repr=False, compare=False)

    @property
    def is_baseline(self) -> bool:
        return self.kind == "baseline"

    @property
    def rows_written(self) -> int:
        return sum(r.rows_written for r in self.summaries)

    @property
    def stall_ms(self) -> float:
        """The slowest rank's stall."""
        return max((r.stall_ms for r in self.summaries), default=0.0)

    @property
    def write_ms(self) -> float:
        """The slowest rank's background write."""
        return max((r.write_ms for r in self.summaries), default=0.0)

    @property
    def files(self) -> list[str]:
        """Every object of every rank: its payload's chunks, and since format 7 its part (by the index alone)."""
        if self.version < 7:
            return [f for r in self.ranks for f in r.payload.files]
        out = []
        for r in self.summaries:
            file = rank_file_of(self.id, r.rank)
            out += [chunk_path(file, k) for k in range(r.chunks)] + [part_path_of(self.id, r.rank)]
        return out

    def entries(self) -> list[tuple[RankReport, str, TableEntry]]:
        """Every (report, table, entry) of the checkpoint, as stored."""
        return [(r, t, e) for r in self.ranks for t, e in r.entries()]

    def rows_of(self, report: RankReport, replicated: bool = True) -> list[tuple[str, TableEntry]]:
        """Every (table, entry) of ``report`` that holds rows; with ``replicated``, each table it stores
        whole (a data_parallel table, on rank 0) too, as one float32 entry spanning the table. So a chain
        whose plans differ (a table replicated in some checkpoints, sharded in others) reads like any other.
        """
        out = report.entries()
        if replicated:
            for table, blob in report.replicated_tables.items():
                rows, cols = self.tables[table]
                out.append((table, TableEntry(rows=(0, rows), cols=(0, cols), encoding="full", weights=None,
                                              replicated=blob)))
        return out
