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
entries), so a region looks at every entry overlapping its rows but loads the encoded rows
of the pieces it owns only.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cnr_torchrec.ckpt.manifest import rank_file
from cnr_torchrec.ckpt.payload import BlobWriter, checksum, unflatten_state
from cnr_torchrec.ckpt.restore import _Reader
from cnr_torchrec.ckpt.save import _encode_ids, decode_ids
from cnr_torchrec.ckpt.storage import Storage
from cnr_torchrec.errors import CompactionError, CorruptCheckpointError
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, get_codec

__all__ = ["Region", "merge_rank", "regions_of_layout"]


@dataclass(frozen=True)
class Region:
    """A block of a table one rank writes in a merge: global rows ``[rows)`` and columns ``[cols)``."""

    table: str
    rows: tuple[int, int]
    cols: tuple[int, int]


@dataclass
class _Stored:
    """One stored entry of the chain (a replicated table counts as one spanning the table)."""

    ckpt: int
    table: str
    entry: Mapping[str, Any]
    load: _Reader

    @property
    def rows(self) -> tuple[int, int]:
        return int(self.entry["rows"][0]), int(self.entry["rows"][1])

    @property
    def cols(self) -> tuple[int, int]:
        return int(self.entry["cols"][0]), int(self.entry["cols"][1])

    def global_rows(self) -> torch.Tensor:
        """The entry's stored rows as global row ids, in stored order."""
        r0, r1 = self.rows
        if "ids" not in self.entry:
            return torch.arange(r0, r1)
        ids = self.entry["ids"]
        offsets = decode_ids(ids["kind"], self.load(ids["blob"]), r1 - r0)
        if offsets.numel() != int(ids["count"]) or (offsets.numel() and int(offsets[-1]) >= r1 - r0):
            raise CorruptCheckpointError(f"{self.load.report['file']}: row ids of table '{self.table}' do not match "
                                         "the entry they describe", path=self.load.report["file"])
        return offsets + r0

    def rows_at(self, positions: torch.Tensor) -> tuple[EncodedRows, list[tuple[bool, torch.Tensor]]]:
        """The stored rows at ``positions``, still encoded, and their optimizer-state rows."""
        if "replicated" in self.entry:  # whole float32 table: as `none` rows, which restore to the same floats
            weights = self.load(self.entry["replicated"]).float().index_select(0, positions)
            return get_codec("none").encode(weights), []
        tensors = {k: self.load(name) for k, name in self.entry["weights"]["blobs"].items()}
        try:
            encoded = EncodedRows.from_tensors(tensors, self.entry["weights"]["meta"])
        except EncodingFormatError as e:
            raise CorruptCheckpointError(f"{self.load.report['file']}: encoded rows of table '{self.table}' are "
                                         f"inconsistent: {e}", path=self.load.report["file"]) from None
        states = [(bool(s["rowwise"]), self.load(s["blob"]).index_select(0, positions))
                  for s in self.entry.get("states", [])]
        return encoded.take(positions), states


def _stored_entries(chain: list[Mapping[str, Any]], storage: Storage) -> dict[str, list[_Stored]]:
    """Every entry of the chain by table, newest checkpoint first."""
    out: dict[str, list[_Stored]] = {}
    for m in reversed(chain):
        for report in m["ranks"]:
            load = _Reader(storage, report, whole=False)
            for table, entries in report["tables"].items():
                out.setdefault(table, []).extend(_Stored(m["id"], table, e, load) for e in entries)
            for table, blob in report.get("replicated_tables", {}).items():
                rows, cols = m["tables"][table]
                entry = {"rows": [0, rows], "cols": [0, cols], "replicated": blob}
                out.setdefault(table, []).append(_Stored(m["id"], table, entry, load))
    return out


def _survivors(region: Region, stored: list[_Stored]) -> list[tuple[_Stored, torch.Tensor, torch.Tensor]]:
    """The pieces ``region`` writes: (entry, positions in it, global rows), the newest per row and segment.

    Raises:
        CompactionError: a piece is partly superseded (a newer piece covers some of its column
            segments only), which no lossless merge can write.
    """
    r0, r1 = region.rows
    edges = sorted({c for s in stored for c in s.cols})
    segments = list(zip(edges[:-1], edges[1:]))
    claimed = torch.zeros(r1 - r0, len(segments), dtype=torch.bool)
    out = []
    for s in stored:  # newest checkpoint first
        if s.rows[1] <= r0 or r1 <= s.rows[0]:
            continue
        rows = s.global_rows()
        positions = torch.nonzero((rows >= r0) & (rows < r1)).flatten()
        if not positions.numel():
            continue
        local = rows.index_select(0, positions) - r0
        cover = [k for k, (a, b) in enumerate(segments) if s.cols[0] <= a and b <= s.cols[1]]
        taken = claimed[local][:, cover]
        partly = taken.any(1) & ~taken.all(1)
        if bool(partly.any()):
            row = int(local[partly][0]) + r0
            raise CompactionError(f"table '{s.table}', row {row}: checkpoint {s.ckpt} holds it for columns {s.cols}, "
                                  "and a newer checkpoint for some of those columns only, so no lossless merge can "
                                  "write it. The chain is kept as it is")
        fresh = ~taken.any(1)
        keep = local[fresh]
        claimed[keep.unsqueeze(1), torch.tensor(cover, dtype=torch.int64)] = True
        if region.cols[0] <= s.cols[0] < region.cols[1] and keep.numel():
            out.append((s, positions[fresh], keep + r0))
    return out


def _group_key(s: _Stored) -> str:
    """Pieces whose rows can sit in one entry: same columns, codec metadata and state layout."""
    if "replicated" in s.entry:
        return json.dumps([s.cols, "replicated"])
    meta = {k: v for k, v in s.entry["weights"]["meta"].items() if k != "num_rows"}
    states = [(st["rowwise"], s.load.report["blobs"][st["blob"]]["dtype"]) for st in s.entry.get("states", [])]
    return json.dumps([s.cols, meta, states], sort_keys=True)


def _concat(parts: list[EncodedRows]) -> EncodedRows:
    first = parts[0]
    return dataclasses.replace(first, **{k: torch.cat([p.to_tensors()[k] for p in parts])
                                         for k in first.to_tensors()})


def _write_group(pieces, prefix: str, blobs: BlobWriter) -> tuple[dict[str, Any], int]:
    """One entry holding ``pieces`` (same group), rows in global order. Returns (entry, rows)."""
    encoded, states, rows = [], [], []
    for s, positions, global_rows in pieces:
        e, st = s.rows_at(positions)
        encoded.append(e)
        states.append(st)
        rows.append(global_rows)
    rows_all = torch.cat(rows)
    order = torch.argsort(rows_all)
    rows_all = rows_all[order]
    merged = _concat(encoded).take(order)
    lo, hi = int(rows_all[0]), int(rows_all[-1]) + 1
    cols = list(pieces[0][0].cols)
    entry: dict[str, Any] = {"rows": [lo, hi], "cols": cols, "encoding": "full"}
    offsets = rows_all - lo
    if offsets.numel() != hi - lo:
        kind, packed = _encode_ids(offsets, hi - lo)
        entry["encoding"] = "rows"
        entry["ids"] = {"kind": kind, "count": int(offsets.numel()), "blob": blobs.add(f"{prefix}/ids", packed)}
    entry["weights"] = {"meta": merged.metadata(),
                        "blobs": {k: blobs.add(f"{prefix}/w/{k}", v) for k, v in merged.to_tensors().items()}}
    entry["states"] = [
        {"rowwise": states[0][j][0],
         "blob": blobs.add(f"{prefix}/state{j}", torch.cat([st[j][1] for st in states]).index_select(0, order))}
        for j in range(len(states[0]))
    ]
    return entry, int(offsets.numel())


def _copy(name: str, load: _Reader, out: BlobWriter) -> str:
    """Copies one blob, byte for byte, under the same name."""
    if name not in out.index:
        out.add(name, load(name))
    return name


def _copy_tree(tree: Any, load: _Reader, out: BlobWriter) -> Any:
    """Copies the blobs a flattened state tree names (the tree stays valid)."""
    unflatten_state(tree, lambda name: _copy(name, load, out))
    return tree


def merge_rank(
    storage: Storage,
    chain: list[Mapping[str, Any]],
    regions: list[Region],
    *,
    new_id: int,
    rank: int,
    rank_state: Mapping[str, Any] | None,
    dense_state: Mapping[str, Any] | None,
    table_shapes: Mapping[str, Any],
) -> dict[str, Any]:
    """Writes this rank's file of ``chain`` (manifests, baseline first) merged into checkpoint ``new_id``.

    Args:
        regions: the blocks this rank writes (see the module docstring).
        rank_state: a tip report whose ``extra`` and ``rng`` this rank copies (None: none).
        dense_state: a tip report whose ``dense`` and ``dense_optimizer`` this rank copies (rank 0).
        table_shapes: every table's shape, for the report.

    Returns:
        The rank's report, with the keys of :func:`~cnr_torchrec.ckpt.save.write_rank`'s.

    Raises:
        CorruptCheckpointError: a file of the chain fails its checks (names it).
        CompactionError: a row cannot be merged without re-encoding it.
    """
    t0 = time.perf_counter()
    stored = _stored_entries(chain, storage)
    blobs = BlobWriter()
    tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = 0
    for region in regions:
        groups: dict[str, list] = {}
        for piece in _survivors(region, stored.get(region.table, [])):
            groups.setdefault(_group_key(piece[0]), []).append(piece)
        for pieces in groups.values():
            entry, n = _write_group(pieces, f"m{sum(map(len, tables.values()))}", blobs)
            tables.setdefault(region.table, []).append(entry)
            rows_written += n
    tip = chain[-1]
    dense = dense_opt = None
    if dense_state is not None:
        load = _Reader(storage, dense_state, whole=False)
        dense = {n: _copy(b, load, blobs) for n, b in dense_state["dense"].items()}
        dense_opt = _copy_tree(dense_state.get("dense_optimizer"), load, blobs)
    extra, rng = {}, None
    if rank_state is not None:
        load = _Reader(storage, rank_state, whole=False)
        extra = {n: _copy_tree(t, load, blobs) for n, t in rank_state.get("extra", {}).items()}
        rng = _copy_tree(rank_state.get("rng"), load, blobs)
    data = blobs.getvalue()
    file = rank_file(new_id, rank)
    storage.write(file, data)
    storage.fsync_file(file)
    return {
        "rank": rank, "ok": True, "file": file, "nbytes": len(data), "xxh3": checksum(data), "blobs": blobs.index,
        "tables": tables, "replicated_tables": {}, "dense": dense or {}, "dense_optimizer": dense_opt,
        "extra": extra, "rng": rng, "tbe_iter": max(int(r.get("tbe_iter", 0)) for r in tip["ranks"]),
        "table_shapes": dict(table_shapes), "rows_written": rows_written, "stall_ms": 0.0,
        "write_ms": round((time.perf_counter() - t0) * 1e3, 3),
    }


def regions_of_layout(tip: Mapping[str, Any]) -> dict[int, list[Region]]:
    """Regions from a checkpoint's own layout, by rank: each report's entry blocks, and on rank 0 every table
    the checkpoint stored replicated (offline compaction keeps the tip's layout)."""
    out: dict[int, list[Region]] = {int(r["rank"]): [] for r in tip["ranks"]}
    for r in tip["ranks"]:
        blocks = {(t, tuple(e["rows"]), tuple(e["cols"])) for t, es in r["tables"].items() for e in es}
        out[int(r["rank"])] += [Region(t, rows, cols) for t, rows, cols in sorted(blocks)]
    for table in tip.get("replicated", []):
        rows, cols = tip["tables"][table]
        out[0].append(Region(table, (0, int(rows)), (0, int(cols))))
    return out
