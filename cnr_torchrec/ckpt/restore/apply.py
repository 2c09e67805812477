"""Applying a chain's entries to the shards this rank holds, newest checkpoint first.

Every stored entry carries the global row range and column range of the shard that wrote
it, and its rows carry offsets into that range. So an entry is applied to whatever shards
overlap it now, whatever the plan was at save time: its overlapping rows and columns are
decoded in place, or written by ``torch.ops.cnr.scatter_rows_`` (added, in a residual chain).
A row already restored from a newer checkpoint is skipped (``torch.ops.cnr.claim_rows_``),
so each row is decoded and written once.

Row-wise optimizer state (one value per row of a column shard) is mapped by column
overlap: when a shard now spans columns that several shards held, its value is their
column-weighted mean, which is exact for row-wise Adagrad's mean of squared gradients
whenever the new shard is a union of old ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from cnr_torchrec.ckpt.format.manifest import Blob, Manifest, TableEntry
from cnr_torchrec.ckpt.format.state import decode_ids
from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError
from cnr_torchrec.ops import claim_rows_, scatter_rows_
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, codec_for, decode
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["Applier"]

log = logging.getLogger("cnr_torchrec.ckpt.restore.chain")  # part of restore's log


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class _Target:
    """One shard this rank holds, and which of its rows the chain has restored so far.

    The chain is applied newest first, so a row takes its value from the newest
    checkpoint that holds it and is decoded and copied once. Columns are tracked in
    segments (the column ranges the chain's entries split the shard into), because a
    chain written under other plans may hold a row for some columns and not others.
    """

    def __init__(self, kernel: Any, shard: Any, breaks: list[int], additive: bool = False) -> None:
        self.kernel, self.shard = kernel, shard
        c0, c1 = shard.cols
        edges = sorted({c0, c1, *(b for b in breaks if c0 < b < c1)})
        self.segments = list(zip(edges[:-1], edges[1:]))
        self.filled = {seg: torch.zeros(shard.num_rows, dtype=torch.bool) for seg in self.segments}
        # Row-wise state comes with the weights of entries that span the shard's columns, and with
        # one segment every overlapping entry does: its rows are then restored exactly when the weights are.
        # (Not in an additive chain: there a residual's state is claimed while its weights are not.)
        self.state_follows_weights = len(self.segments) == 1 and not additive
        self.state_filled = (next(iter(self.filled.values())) if self.state_follows_weights
                             else torch.zeros(shard.num_rows, dtype=torch.bool))
        self.weights = kernel.tbe.split_embedding_weights()[shard.local_index]
        live = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
        self.states = list(live[shard.local_index]) if live else []
        self.has_rowwise = False  # row-wise state is tracked apart (per-column state follows the weights)
        self.done = shard.num_rows == 0

    def refresh(self) -> None:
        """Updates ``done``: every row of every segment (and its row-wise state) restored.

        Checked once per checkpoint of the chain, not per entry: a mask scan is dearer
        than the few entries it could skip within one checkpoint.
        """
        self.done = all(_all(f) for f in self.filled.values()) and (not self.has_rowwise or _all(self.state_filled))

    def columns(self, live: torch.Tensor, seg: tuple[int, int]) -> torch.Tensor:
        """The columns ``seg`` (global) of ``live``, a [rows, shard columns] view."""
        x, y = seg[0] - self.shard.cols[0], seg[1] - self.shard.cols[0]
        return live if (x, y) == (0, live.shape[1]) else live[:, x:y]


class Applier:
    """Applies a chain's entries to this rank's shards, newest checkpoint first.

    For each entry and shard, ``claim_rows_`` maps the entry's stored rows to the shard
    rows that no newer checkpoint restored (-1 for the rest) and marks them restored;
    the rows are then decoded (or copied) straight to their places by that map.
    """

    def __init__(self, tracker: DirtyRowTracker, manifests: list[Manifest], replicated: bool = True,
                 stats: dict[str, float] | None = None) -> None:
        self._stats = stats  # gets minimal_bytes: the stored bytes of the rows that are applied
        breaks: dict[str, set[int]] = {}
        for m in manifests:
            for report in m.ranks:
                for table, entry in m.rows_of(report, replicated):
                    breaks.setdefault(table, set()).update(entry.cols)
        # A chain with residual entries (quantization.residual) adds up: a row is its newest whole entry
        # plus every newer residual, so the weights start from zero and every entry adds to them.
        self.additive = any(e.residual for m in manifests for _, _, e in m.entries())
        self.targets = {
            table: [_Target(k, s, sorted(cuts), self.additive) for k, s in tracker.shards(table)]
            for table, cuts in breaks.items()
        }
        # Row-wise state of the checkpoint being applied, to merge: id(target) -> (target, [(state, rows, values,
        # column weight)]).
        self._rowwise: dict[int, tuple[_Target, list[tuple[int, torch.Tensor, torch.Tensor, float]]]] = {}
        if self.additive:
            with torch.no_grad():
                for t in (t for ts in self.targets.values() for t in ts):
                    t.weights.zero_()

    def done(self) -> bool:
        return all(t.done for ts in self.targets.values() for t in ts)

    def _hits(self, table: str, entry: TableEntry) -> list[tuple[_Target, tuple[int, int], tuple[int, int]]]:
        rows, cols = entry.rows, entry.cols
        return [
            (t, r, c)
            for t in self.targets.get(table, ())
            if not t.done and (r := _overlap(rows, t.shard.rows)) and (c := _overlap(cols, t.shard.cols))
        ]

    def wants(self, table: str, entry: TableEntry) -> bool:
        """Whether ``entry`` holds rows of this rank's shards that no newer checkpoint restored."""
        return bool(self._hits(table, entry))

    def apply(self, table: str, entry: TableEntry, load: Any) -> None:
        hits = self._hits(table, entry)
        if not hits:
            return
        rows, cols = entry.rows, entry.cols
        n_rows = entry.num_rows
        if entry.ids is not None:
            offsets = decode_ids(entry.ids.kind, load(entry.ids.blob), n_rows)
            if offsets.numel() != entry.ids.count or (offsets.numel() and int(offsets[-1]) >= n_rows):
                raise CorruptCheckpointError("row ids do not match the entry they describe")
        else:
            offsets = None  # every row of the entry, in order
        encoded = weights = None
        if entry.replicated is not None:
            weights = load(entry.replicated).float()
            n_stored = weights.shape[0]
        else:
            tensors = {k: load(name) for k, name in entry.weights.blobs.items()}
            try:
                encoded = EncodedRows.from_tensors(tensors, dict(entry.weights.meta))
            except EncodingFormatError as e:
                raise CorruptCheckpointError(f"encoded rows of table '{table}' are inconsistent: {e}") from None
            n_stored = encoded.num_rows
        if n_stored != (n_rows if offsets is None else offsets.numel()):
            raise CorruptCheckpointError(f"table '{table}': {n_stored} rows stored for the entry's ids")
        row_bytes = self._row_bytes(entry, load.payload.blobs, n_stored)
        states = [(s.rowwise, load(s.blob)) for s in entry.states]
        residual = entry.residual
        if residual and any(not rowwise for rowwise, _ in states):
            raise IncompatibleCheckpointError(
                f"table '{table}': a residual entry with per-column optimizer state; residual coding supports "
                "row-wise optimizer state only (EXACT_ROWWISE_ADAGRAD, SGD)")
        for target, row_ov, col_ov in hits:
            maps, segs = self._apply_one(table, target, rows, cols, row_ov, col_ov, offsets, n_stored, encoded,
                                         weights, states, residual)
            if self._stats is not None:
                width = cols[1] - cols[0]
                applied = sum(int((m >= 0).sum()) * (seg[1] - seg[0]) / width for seg, m in zip(segs, maps))
                self._stats["minimal_bytes"] = self._stats.get("minimal_bytes", 0) + round(applied * row_bytes)

    def _row_bytes(self, entry: TableEntry, blobs: Mapping[str, Blob], n_stored: int) -> float:
        """Bytes an entry stores per row: its encoded (or float32) row, with its optimizer state (ids left out)."""
        if self._stats is None or not n_stored:
            return 0.0
        names = [entry.replicated] if entry.replicated is not None else list(entry.weights.blobs.values())
        return sum(blobs[n].nbytes for n in names + [s.blob for s in entry.states]) / n_stored

    def _apply_one(self, table, target, rows, cols, row_ov, col_ov, offsets, n_stored, encoded, weights,
                   states, residual) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Applies one entry to one shard it overlaps. Returns the claim map of each column segment, and the
        segments."""
        shard = target.shard
        # Stored rows at entry rows [lo, hi) overlap the shard; entry row o is shard row o + shift.
        lo, hi, shift = row_ov[0] - rows[0], row_ov[1] - rows[0], rows[0] - shard.rows[0]
        segs = [seg for seg in target.segments if col_ov[0] <= seg[0] and seg[1] <= col_ov[1]]
        # A residual adds to the rows no newer whole entry restored, and claims none of them.
        maps = [claim_rows_(target.filled[seg].clone() if residual else target.filled[seg], offsets, n_stored, lo,
                            hi, shift) for seg in segs]
        if states and len(target.states) != len(states):
            log.warning("table '%s': checkpoint has %d optimizer states, the model %d; states not restored",
                        table, len(states), len(target.states))
            states = []
        with torch.no_grad():
            if not self.additive and encoded is not None and len(segs) == 1 and segs[0] == cols:
                # One segment spanning the stored columns (the usual case): decode straight into place.
                codec_for(encoded).decode_into(encoded, target.columns(target.weights, segs[0]), maps[0])
            else:
                # Some segments of the stored columns, or an additive chain: decode the rows any segment
                # needs, once, then write (or add) them.
                needed = maps[0] >= 0
                for m in maps[1:]:
                    needed |= m >= 0
                sel = _nonzero(needed)
                if sel.numel():
                    vals = weights.index_select(0, sel) if weights is not None else decode(encoded.take(sel))
                    put = self._add if self.additive else self._scatter
                    for seg, m in zip(segs, maps):
                        put(target, target.weights, seg, cols, m.index_select(0, sel), vals)
            for j, (rowwise, saved) in enumerate(states):
                if not rowwise:  # per-column state: where the weights went
                    live = target.states[j].reshape(shard.num_rows, -1)
                    for seg, m in zip(segs, maps):
                        self._scatter(target, live, seg, cols, m, saved)
        rowwise = [(j, saved) for j, (rw, saved) in enumerate(states) if rw]
        if rowwise:
            claimed = maps[0] if target.state_follows_weights else None  # never in an additive chain
            self._apply_rowwise(target, col_ov, offsets, n_stored, lo, hi, shift, rowwise, claimed)
        return maps, segs

    @staticmethod
    def _scatter(target, live, seg, cols, index, stored) -> None:
        """Writes columns ``seg`` of ``stored`` rows to ``live`` rows ``index`` (negative: skipped)."""
        part = stored[:, seg[0] - cols[0] : seg[1] - cols[0]]
        out = target.columns(live, seg)
        scatter_rows_(out, index.to(out.device), part.to(device=out.device, dtype=out.dtype))

    @staticmethod
    def _add(target, live, seg, cols, index, stored) -> None:
        """Adds columns ``seg`` of ``stored`` rows to ``live`` rows ``index`` (negative: skipped)."""
        keep = _nonzero(index >= 0)
        part = stored.index_select(0, keep)[:, seg[0] - cols[0] : seg[1] - cols[0]]
        out = target.columns(live, seg)
        out.index_add_(0, index.index_select(0, keep).to(out.device), part.to(device=out.device, dtype=out.dtype))

    def _apply_rowwise(self, target, col_ov, offsets, n_stored, lo, hi, shift, rowwise, claimed) -> None:
        """Row-wise optimizer state (one value per row of a column shard), merged by column overlap.

        ``claimed``: the rows the weights just claimed, when the state follows them.
        """
        shard = target.shard
        target.has_rowwise = True
        weight = (col_ov[1] - col_ov[0]) / (shard.cols[1] - shard.cols[0])
        if weight == 1.0:  # the entry spans the shard's columns: its value is the value
            index = claimed if claimed is not None else claim_rows_(target.state_filled, offsets, n_stored, lo, hi,
                                                                    shift)
            with torch.no_grad():
                for j, saved in rowwise:
                    live = target.states[j].reshape(shard.num_rows, 1)
                    scatter_rows_(live, index.to(live.device), saved.to(live).view(-1, 1))
            return
        # Part of the shard's columns: collect, and merge at the end of the checkpoint (claimed then).
        index = claim_rows_(target.state_filled.clone(), offsets, n_stored, lo, hi, shift)
        src = _nonzero(index >= 0)
        dst = index.index_select(0, src)
        for j, saved in rowwise:
            self._rowwise.setdefault(id(target), (target, []))[1].append(
                (j, dst, saved.index_select(0, src).float(), weight))

    def finish_checkpoint(self) -> None:
        """Writes the row-wise states merged from the checkpoint's column shards, marks them restored,
        and updates which shards are done."""
        for target, parts in self._rowwise.values():
            n = target.shard.num_rows
            merged_rows = []
            for j in sorted({p[0] for p in parts}):
                live = target.states[j].reshape(n)
                acc = torch.zeros(n, dtype=torch.float64)
                wsum = torch.zeros(n, dtype=torch.float64)
                for _, dst, vals, weight in (p for p in parts if p[0] == j):
                    acc.index_add_(0, dst, vals.double() * weight)
                    wsum.index_add_(0, dst, torch.full((dst.numel(),), weight, dtype=torch.float64))
                rows = _nonzero(wsum != 0)
                with torch.no_grad():
                    live.index_copy_(0, rows.to(live.device), (acc[rows] / wsum[rows]).to(live))
                merged_rows.append(rows)
            for rows in merged_rows:
                target.state_filled[rows] = True
        self._rowwise.clear()
        for ts in self.targets.values():
            for t in ts:
                if not t.done:
                    t.refresh()


def _all(mask: torch.Tensor) -> bool:
    """Whether every entry of a 1-D CPU bool mask is set (numpy's all: 20x torch's here)."""
    return bool(mask.numpy().all())


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the set entries of a 1-D CPU bool mask (numpy's flatnonzero: 9x torch.nonzero here)."""
    return torch.from_numpy(np.flatnonzero(mask.numpy()))
