"""Lossless merge of a chain into one baseline: each row keeps the stored bytes of the newest checkpoint
that holds it.

Codecs encode rows one by one (every tensor of :class:`~cnr_torchrec.quant.EncodedRows` holds
one entry per row), so picking rows out of stored entries and putting them side by side is
exact: nothing is decoded and encoded again, and a restore of the merged baseline decodes
the very bytes a restore of the chain decodes.

Each rank merges *regions*: blocks of tables, its shards under the plan it runs now. A
stored piece (one row of an entry, over the entry's columns) belongs to the region that
holds its row and its first column, so every piece is written by exactly one rank whatever
plans the chain was written under. Which pieces survive is decided as a restore decides it:
newest checkpoint first, per row and column segment (the column edges of the chain's
entries), so a region looks at every entry overlapping its rows (their row ids only) but
loads the encoded rows of the pieces it owns only. A row that no stored piece reproduces (a piece
partly superseded by a newer one, or, with row-wise optimizer state, a row whose pieces come
from several checkpoints) raises CompactionError: only re-encoding could merge it.

A replicated table (rank 0 stores it whole in float32) takes part like an entry spanning the
table; its surviving rows are written as ``none`` rows, whose payload is those float32 bytes.
The merged checkpoint therefore holds entries only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

from cnr_torchrec.ckpt.format.blocks import Region
from cnr_torchrec.ckpt.format.bytes.chunks import DEFAULT_CHUNK_BYTES, IOPool, PayloadReader, PayloadWriter
from cnr_torchrec.ckpt.format.bytes.payload import BlobWriter, unflatten_state
from cnr_torchrec.ckpt.format.bytes.rows import RowReader, write_rows
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import rank_file
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport, TableEntry
from cnr_torchrec.ckpt.format.precedence import Coverage, closes, newest_first, segments_of
from cnr_torchrec.ckpt.format.row_ids import encode_ids, stored_offsets
from cnr_torchrec.ckpt.format.writing import StateBlobs, WriteCounts, rank_report, table_entry
from cnr_torchrec.errors import CompactionError, CorruptCheckpointError
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, get_codec, rebuild

__all__ = ["CompactedFile", "compacted_report", "copy_blob", "copy_blob_tree", "copy_state", "merge_rank",
           "none_rows"]


def none_rows(weights: torch.Tensor) -> EncodedRows:
    """float32 rows as ``none``-codec rows: their bytes are the payload, so they decode to the same floats."""
    rows = weights.float().contiguous()
    payload = rows.view(torch.uint8).reshape(rows.shape[0], 4 * rows.shape[1])
    return EncodedRows(method="none", bits=32, dim=rows.shape[1], params=get_codec("none").params, payload=payload)


@dataclass
class _Stored:
    """One stored entry of the chain (a replicated table counts as one spanning the table)."""

    ckpt: int
    table: str
    entry: TableEntry
    load: RowReader
    _global: torch.Tensor | None = field(default=None, repr=False)  # row ids, read once for every region

    @property
    def rows(self) -> tuple[int, int]:
        return self.entry.rows

    @property
    def cols(self) -> tuple[int, int]:
        return self.entry.cols

    def corrupt(self, what: str) -> CorruptCheckpointError:
        file = self.load.payload.file
        return CorruptCheckpointError(f"{file}: table '{self.table}' (checkpoint {self.ckpt}): {what}", path=file)

    def global_rows(self) -> torch.Tensor:
        """The entry's stored rows as global row ids, in stored order (its ids blob is read once)."""
        if self._global is None:
            r0, r1 = self.rows
            file = self.load.payload.file
            offsets = stored_offsets(self.entry, self.load, f"{file}: table '{self.table}' (checkpoint {self.ckpt}): ",
                                     file)
            self._global = torch.arange(r0, r1) if offsets is None else offsets + r0
        return self._global

    def group_key(self) -> str:
        """Pieces with equal keys fit in one entry: same columns, codec metadata and state layout."""
        if self.entry.replicated is not None:
            meta = none_rows(torch.empty(0, self.cols[1] - self.cols[0])).metadata()
        else:
            meta = dict(self.entry.coded.meta)
        meta.pop("num_rows", None)
        states = []
        for s in self.entry.states:
            blob = self.load.payload.blobs[s.blob]
            states.append([s.rowwise, blob.dtype, list(blob.shape)[1:]])
        mc = list(self.entry.mc.fields) if self.entry.mc is not None else None
        return json.dumps([list(self.cols), meta, states, mc], sort_keys=True)

    def rows_at(self, positions: torch.Tensor) -> tuple[EncodedRows, list[tuple[bool, torch.Tensor]],
                                                      torch.Tensor | None]:
        """The stored rows at ``positions``, still encoded, their optimizer-state rows and managed-collision
        state (None for other tables)."""
        n = self.global_rows().numel()
        if self.entry.replicated is not None:
            weights = self.load(self.entry.replicated)
            if tuple(weights.shape) != (n, self.cols[1] - self.cols[0]):
                raise self.corrupt(f"the replicated table is {list(weights.shape)}, not {[n, self.cols[1]]}")
            return none_rows(weights.index_select(0, positions)), [], None
        keys = sorted(self.entry.coded.blobs)
        wanted, back = torch.unique(positions, return_inverse=True)  # sorted, as a RowReader reads them
        rows = [t.index_select(0, back) for t in self.load.rows(self.entry, wanted)]
        try:
            encoded = rebuild(dict(zip(keys, rows)),
                                               {**self.entry.coded.meta, "num_rows": positions.numel()})
        except EncodingFormatError as e:
            raise self.corrupt(f"encoded rows are inconsistent: {e}") from None
        if encoded.dim != self.cols[1] - self.cols[0]:
            raise self.corrupt(f"{encoded.dim} values a row stored for columns {self.cols}")
        states = [(s.rowwise, t) for s, t in zip(self.entry.states, rows[len(keys):])]
        return encoded, states, rows[-1] if self.entry.mc is not None else None


def _stored_entries(chain: list[Manifest], storage: Storage) -> dict[str, list[_Stored]]:
    """Every entry of the chain by table, newest checkpoint first. Nothing is read yet: blobs are
    range-read as needed (a rank needs a few of each file)."""
    out: dict[str, list[_Stored]] = {}
    for m in newest_first(chain):
        for report in m.ranks:
            load = RowReader(storage, report.payload)
            for table, entry in m.rows_of(report):
                if entry.residual:
                    raise CompactionError(
                        f"checkpoint {m.id} stores residual rows (quantization.residual): a row is the sum of "
                        "several checkpoints' bytes, so no single stored row can be kept. Fold the chain instead "
                        "(cnr_torchrec.ckpt.compact.fold.fold_rank; `cnr compact` does so), which stores the sums "
                        "in float32")
                out.setdefault(table, []).append(_Stored(m.id, table, entry, load))
    return out


def _survivors(region: Region, stored: list[_Stored]) -> list[tuple[_Stored, torch.Tensor, torch.Tensor]]:
    """The pieces ``region`` writes: (entry, positions in it, global rows), the newest per row and segment, by
    the chain's rule (:mod:`~cnr_torchrec.ckpt.format.precedence`; a merged chain holds whole copies only).

    Raises:
        CompactionError: a piece is partly superseded (a newer piece covers some of its column
            segments only), which no lossless merge can write.
    """
    r0, r1 = region.rows
    width = max((s.cols[1] for s in stored), default=0)
    segments = segments_of((0, width), [c for s in stored for c in s.cols])
    coverage = Coverage(r1 - r0, segments)
    source = torch.full((r1 - r0, len(segments)), -1, dtype=torch.int64)  # the checkpoint each row and segment keeps
    out = []
    for s in stored:  # newest checkpoint first
        if s.rows[1] <= r0 or r1 <= s.rows[0]:
            continue
        rows = s.global_rows()
        cover = [k for k, (a, b) in enumerate(segments) if s.cols[0] <= a and b <= s.cols[1]]
        at = (max(s.rows[0], r0) - s.rows[0], min(s.rows[1], r1) - s.rows[0], s.rows[0] - r0)
        taken = torch.stack([coverage.claim(segments[k], rows - s.rows[0], rows.numel(), *at, closes=closes(s.entry))
                             >= 0 for k in cover], 1)  # the row was open in that segment, and this piece took it
        inside = (rows >= r0) & (rows < r1)
        partly = inside & taken.any(1) & ~taken.all(1)
        if bool(partly.any()):
            i = int(torch.nonzero(partly)[0])
            row = int(rows[i])
            _partly_superseded(s, row, sorted(set(source[row - r0, cover].tolist()) - {-1}))
        positions = torch.from_numpy(np.flatnonzero((inside & taken.all(1)).numpy()))
        if not positions.numel():
            continue
        local = rows.index_select(0, positions) - r0
        source[local.unsqueeze(1), torch.tensor(cover, dtype=torch.int64)] = s.ckpt
        if region.cols[0] <= s.cols[0] < region.cols[1]:
            out.append((s, positions, local + r0))
    if any(st.rowwise for s in stored for st in s.entry.states):
        _check_one_source(region, source)
    return out


def _check_one_source(region: Region, claimer: torch.Tensor) -> None:
    """Raises CompactionError for a row whose surviving pieces come from several checkpoints.

    A restore merges row-wise optimizer state per checkpoint: the chain gives such a row the
    state of its newest checkpoint, but one merged checkpoint would give the mean over all its
    pieces, onto a shard that spans them. (TorchRec writes a dirty row for all its column
    shards, so each row's pieces come from one checkpoint.)
    """
    top = claimer.max(1).values
    low = torch.where(claimer >= 0, claimer, top.unsqueeze(1)).min(1).values
    mixed = torch.nonzero(low != top).flatten()
    if mixed.numel():
        i = int(mixed[0])
        ckpts = sorted(set(claimer[i].tolist()) - {-1})
        raise CompactionError(
            f"cannot merge table '{region.table}' losslessly: row {region.rows[0] + i} keeps columns stored by "
            f"checkpoints {ckpts}, and its row-wise optimizer state would then restore as their mean instead of "
            "as the chain restores it. The chain is kept as it is; merge it with a codec instead "
            "(`cnr compact --method ...` decodes and re-encodes the rows)")


def _partly_superseded(s: _Stored, row: int, newer: list[int]) -> NoReturn:
    """Raises the CompactionError of a row that checkpoint ``s.ckpt`` holds over more columns than ``newer`` do."""
    raise CompactionError(
        f"cannot merge table '{s.table}' losslessly: checkpoint {s.ckpt} stores row {row} for columns "
        f"[{s.cols[0]}, {s.cols[1]}), and newer checkpoint(s) {newer} store it for some of those columns only, "
        "so no stored row holds its current value whole. The chain is kept as it is; merge it with a codec "
        "instead (`cnr compact --method ...` decodes and re-encodes the rows)")


def _concat(parts: list[EncodedRows]) -> EncodedRows:
    first = parts[0]
    tensors = [p.to_tensors() for p in parts]
    return first.with_tensors({k: torch.cat([t[k] for t in tensors]) for k in tensors[0]})


def _write_group(pieces: list[tuple[_Stored, torch.Tensor, torch.Tensor]], prefix: str,
                 blobs: BlobWriter) -> tuple[dict[str, Any], int]:
    """One entry holding ``pieces`` (one group), rows in global order. Returns (entry, rows)."""
    encoded, states, mc, rows = [], [], [], []
    for s, positions, global_rows in pieces:
        e, st, m = s.rows_at(positions)
        encoded.append(e)
        states.append(st)
        mc.append(m)
        rows.append(global_rows)
    rows_all = torch.cat(rows)
    order = torch.argsort(rows_all)
    rows_all = rows_all[order]
    merged = _concat(encoded).take(order)
    lo, hi = int(rows_all[0]), int(rows_all[-1]) + 1
    ids = None
    if rows_all.numel() != hi - lo:  # not one contiguous range: which rows, as save writes them
        kind, packed = encode_ids(rows_all - lo, hi - lo)
        ids = (kind, int(rows_all.numel()), blobs.add(f"{prefix}/ids", packed))
    mc_rows = None
    if mc[0] is not None:  # a managed-collision table: every piece holds its by-row state
        pieces_mc = [m for m in mc if m is not None]
        assert len(pieces_mc) == len(mc)  # one group: its pieces share an entry layout
        by_row = torch.cat(pieces_mc).index_select(0, order)
        mc_rows = (by_row, pieces[0][0].entry.mc_rows.fields)
    stored = write_rows(blobs, prefix, merged, [
        (torch.cat([st[j][1] for st in states]).index_select(0, order), states[0][j][0]) for j in range(len(states[0]))
    ], mc_rows)
    entry = table_entry((lo, hi), pieces[0][0].cols, "full" if ids is None else "rows", stored, ids=ids)
    return entry, int(rows_all.numel())


def _merge_tables(stored: dict[str, list[_Stored]], regions: list[Region],
                  blobs: BlobWriter) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """The entries of ``regions``: per region, one entry per group of surviving pieces."""
    tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = 0
    for region in regions:
        groups: dict[str, list[tuple[_Stored, torch.Tensor, torch.Tensor]]] = {}
        for piece in _survivors(region, stored.get(region.table, [])):
            groups.setdefault(piece[0].group_key(), []).append(piece)
        for pieces in groups.values():
            entry, n = _write_group(pieces, f"m{sum(map(len, tables.values()))}", blobs)
            tables.setdefault(region.table, []).append(entry)
            rows_written += n
    return tables, rows_written


def copy_blob(name: str, load: PayloadReader, out: BlobWriter) -> str:
    """Copies one blob, byte for byte, under the same name."""
    if name not in out.index:
        out.add(name, load(name))
    return name


def copy_blob_tree(tree: Any, load: PayloadReader, out: BlobWriter) -> Any:
    """Copies the blobs a flattened state tree names (the tree stays valid)."""
    unflatten_state(tree, lambda name: copy_blob(name, load, out))
    return tree


@dataclass(frozen=True)
class CompactedFile:
    """The file a compaction writes on one rank: where, how, and what it copies from the tip beside its tables.

    Attributes:
        new_id: the compacted checkpoint's id.
        rank: the rank whose file it is, which names it.
        rank_state: a tip rank report whose ``extra``, ``rng`` and ``mc_runtime`` the file copies (None:
            ``extra={}``, ``rng=None``).
        dense_state: a tip rank report whose ``dense`` and ``dense_optimizer`` the file copies (rank 0's file
            copies the tip's rank 0 report; None: ``dense={}``, ``dense_optimizer=None``).
        chunk_bytes: the size of its chunks.
        pool: the threads that write them (None: the calling thread).
    """

    new_id: int
    rank: int
    rank_state: RankReport | None = None
    dense_state: RankReport | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    pool: IOPool | None = None

    def writer(self, storage: Storage) -> PayloadWriter:
        """The payload writer of this file under ``storage``."""
        return PayloadWriter(storage, rank_file(self.new_id, self.rank), self.chunk_bytes, self.pool)


def copy_state(storage: Storage, rank_state: RankReport | None, dense_state: RankReport | None,
               blobs: BlobWriter) -> StateBlobs:
    """The report's state a merge copies from the tip: dense and dense_optimizer, extra, rng and mc_runtime
    (``replicated_tables`` empty: the merged checkpoint holds entries only)."""
    dense: dict[str, str] = {}
    dense_optimizer = rng = None
    extra: dict[str, Any] = {}
    mc_runtime: dict[str, Any] = {}
    if dense_state is not None:
        load = PayloadReader(storage, dense_state.payload, whole=False)
        dense = {n: copy_blob(b, load, blobs) for n, b in dense_state.dense.items()}
        dense_optimizer = copy_blob_tree(dense_state.dense_optimizer, load, blobs)
    if rank_state is not None:
        load = PayloadReader(storage, rank_state.payload, whole=False)
        extra = {n: copy_blob_tree(t, load, blobs) for n, t in rank_state.extra.items()}
        rng = copy_blob_tree(rank_state.rng, load, blobs)
        mc_runtime = {t: copy_blob_tree(v, load, blobs) for t, v in rank_state.mc_runtime.items()}
    return StateBlobs(dense=dense, dense_optimizer=dense_optimizer, extra=extra, rng=rng, mc_runtime=mc_runtime)


def merge_rank(storage: Storage, chain: list[Manifest], regions: list[Region], out: CompactedFile) -> dict[str, Any]:
    """Writes this rank's file ``out`` of ``chain`` merged into checkpoint ``out.new_id``, keeping every row's
    stored bytes.

    Args:
        storage: the checkpoint root.
        chain: the chain's manifests, baseline first.
        regions: the blocks this rank writes; over all ranks they must partition every table's
            (row, first column) space (see the module docstring).
        out: the file, and the tip's reports whose state it copies.

    Returns:
        The rank's report, with the keys of :func:`~cnr_torchrec.ckpt.save.writer.write_rank`'s
        (``replicated_tables`` empty: the merged checkpoint holds entries only).

    Raises:
        CorruptCheckpointError: a file of the chain fails its checks (names it).
        CompactionError: a row cannot be merged without re-encoding it; nothing is written.
    """
    t0 = time.perf_counter()
    blobs = out.writer(storage)
    tables, rows_written = _merge_tables(_stored_entries(chain, storage), regions, blobs)
    return compacted_report(storage, chain, out, tables, rows_written, blobs, t0)


def compacted_report(storage: Storage, chain: list[Manifest], out: CompactedFile,
                     tables: dict[str, list[dict[str, Any]]], rows_written: int, blobs: PayloadWriter,
                     t0: float) -> dict[str, Any]:
    """A compacted rank file's report, once its ``tables`` are written: the tip's state copied (see
    :func:`copy_state`), the payload finished."""
    copied = copy_state(storage, out.rank_state, out.dense_state, blobs)
    return rank_report(
        out.rank, blobs.finish(), tables=tables, table_shapes=chain[-1].tables,
        tbe_iter=max(r.tbe_iter for r in chain[-1].ranks),
        counts=WriteCounts(rows_written, write_ms=(time.perf_counter() - t0) * 1e3), state=copied,
    )
