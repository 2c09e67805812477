"""Applying a chain's entries to the shards this rank holds, newest checkpoint first.

Every stored entry carries the global row range and column range of the shard that wrote
it, and its rows carry offsets into that range. So an entry is applied to whatever shards
overlap it now, whatever the plan was at save time: its overlapping rows and columns are
decoded in place, or written by ``torch.ops.cnr.scatter_rows_`` (added, in a residual chain).
Which stored copy of a row wins, and how residuals add up, is the chain's one rule
(:mod:`~cnr_torchrec.ckpt.format.precedence`): a row closed by a newer whole copy is skipped, so each
row is read, decoded and written once (added, in a residual chain, once per copy above its whole one).

Each entry is applied in two steps: :meth:`Applier.plan` reads its row ids and claims the
rows this rank still needs, which names the stored rows to read (``EntryPlan.sel``); once a
reader has fetched those rows (:class:`~cnr_torchrec.ckpt.format.bytes.rows.RowReader`, only their
byte ranges), :meth:`Applier.apply` decodes them into place.

Row-wise optimizer state (one value per row of a column shard) is mapped by column
overlap: when a shard now spans columns that several shards held, its value is their
column-weighted mean, which is exact for row-wise Adagrad's mean of squared gradients
whenever the new shard is a union of old ones.

A managed-collision table's by-row state (raw id and eviction metadata) is claimed by row
like the rest, from the newest entry that holds it, and handed to the module at the end
(:meth:`Applier.finish`). Slots move only with the plan's row ranges; a restore onto
other ranges relocates by raw id instead (:mod:`~cnr_torchrec.ckpt.restore.relocate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cnr_torchrec.ckpt.format.blocks import shard_key
from cnr_torchrec.ckpt.format.commits import manifest_path
from cnr_torchrec.ckpt.format.manifest import Blob, Manifest, RankReport, TableEntry
from cnr_torchrec.ckpt.format.precedence import Coverage, closes, segments_of
from cnr_torchrec.ckpt.format.row_ids import stored_offsets
from cnr_torchrec.ckpt.restore.host_copies import Key, StagedWeights, can_stage, fits, host_copy
from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError
from cnr_torchrec.ops import claim_rows_, scatter_rows_
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, codec_for, decode, rebuild
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.track.managed_collision import McTable

__all__ = ["Applier", "EntryPlan", "READ_ALL_FRACTION"]

log = logging.getLogger(__name__)

READ_ALL_FRACTION = 0.75
"""An entry of which a restore needs at least this share of the stored rows is read whole."""



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

    def __init__(self, kernel: Any, shard: Any, breaks: list[int], additive: bool = False,
                 mc: McTable | None = None, stage: bool = False, buffer: torch.Tensor | None = None,
                 fresh: bool = True) -> None:
        self.kernel, self.shard = kernel, shard
        self.key = shard_key(shard.table, shard.rows, shard.cols)
        self.coverage = Coverage(shard.num_rows, segments_of(tuple(shard.cols), breaks))  # which copy wins
        self.segments = list(self.coverage.filled)
        self.filled = self.coverage.filled
        # Row-wise state comes with the weights of entries that span the shard's columns, and with
        # one segment every overlapping entry does: its rows are then restored exactly when the weights are.
        # (Not in an additive chain: there a residual's state is claimed while its weights are not.)
        self.state_follows_weights = len(self.segments) == 1 and not additive
        self.state_filled = (next(iter(self.filled.values())) if self.state_follows_weights
                             else torch.zeros(shard.num_rows, dtype=torch.bool))
        weights = kernel.tbe.split_embedding_weights()[shard.local_index]
        # Staged: the rows are restored into a host copy, and reach the live weights only at commit (restore
        # puts them there once every rank has succeeded). The copy is ``buffer`` where it fits (the residual
        # reconstruction's rows, given up for the restore: memory the process holds already) or new. An additive
        # chain starts from zero; another leaves the copy as it is, and the rows no entry restored are taken
        # from the live weights at the end. Without ``fresh``, only a shard with a buffer is staged: the others
        # are written in place, after every byte was checked (:attr:`Applier.checks_first`).
        self.live = weights if stage and can_stage(weights) and (fresh or fits(buffer, weights)) else None
        self.additive = additive
        self.weights = weights if self.live is None else host_copy(weights, buffer)
        # New host memory this target holds for the restore (the rows of a staged copy that is no buffer).
        self.copy_bytes = (weights.numel() * weights.element_size()
                           if self.live is not None and self.weights is not buffer else 0)
        if additive:
            with torch.no_grad():
                self.weights.zero_()
        live = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
        self.states = list(live[shard.local_index]) if live else []
        self.has_rowwise = False  # row-wise state is tracked apart (per-column state follows the weights)
        # A managed-collision table's by-row state, claimed apart too (the newest entry's, residual or not),
        # and given to its module once the chain is applied (:meth:`Applier.finish`).
        self.mc = mc
        self.mc_state = mc.by_row() if mc is not None else None
        self.mc_filled = torch.zeros(shard.num_rows, dtype=torch.bool) if mc is not None else None
        self.done = shard.num_rows == 0

    def refresh(self) -> None:
        """Updates ``done``: every row of every segment (and its row-wise state) restored.

        Checked once per checkpoint of the chain, not per entry: a mask scan is dearer
        than the few entries it could skip within one checkpoint.
        """
        self.done = (all(_all(f) for f in self.filled.values()) and (not self.has_rowwise or _all(self.state_filled))
                     and (self.mc_filled is None or _all(self.mc_filled)))

    def fill_staged(self) -> None:
        """The rows of a staged copy that no entry restored, from the live weights (not in an additive
        chain, whose copy holds what the chain adds up from zero, as the live weights would)."""
        if self.live is None or self.additive:
            return
        with torch.no_grad():
            for seg, mask in self.filled.items():
                rows = _nonzero(~mask)
                if rows.numel():
                    self.columns(self.weights, seg)[rows] = self.columns(self.live, seg)[rows]

    def columns(self, live: torch.Tensor, seg: tuple[int, int]) -> torch.Tensor:
        """The columns ``seg`` (global) of ``live``, a [rows, shard columns] view."""
        x, y = seg[0] - self.shard.cols[0], seg[1] - self.shard.cols[0]
        return live if (x, y) == (0, live.shape[1]) else live[:, x:y]


@dataclass
class _Claim:
    """The rows of one entry that one shard takes: per column segment, and for its row-wise state."""

    target: _Target
    segs: list[tuple[int, int]]
    maps: list[torch.Tensor]  # per segment: the shard row of each stored row, -1 for rows it does not take
    with_states: bool  # the entry's optimizer states fit the shard's
    state_map: torch.Tensor | None  # row-wise state's map, when the entry has one
    weight: float  # the share of the shard's columns the entry holds (row-wise state is merged by it)
    mc_map: torch.Tensor | None = None  # the managed-collision state's map, when the entry and shard have one


@dataclass
class EntryPlan:
    """What one entry gives this rank: its claims, and the stored rows they need (``sel``, sorted)."""

    table: str
    entry: TableEntry
    claims: list[_Claim]
    sel: torch.Tensor
    row_bytes: float  # stored bytes a row (0 without stats)


class Applier:
    """Applies a chain's entries to this rank's shards, newest checkpoint first.

    For each entry and shard, ``claim_rows_`` maps the entry's stored rows to the shard
    rows that no newer checkpoint restored (-1 for the rest) and marks them restored
    (:meth:`plan`); the rows read are then decoded (or copied) straight to their places by
    that map (:meth:`apply`).
    """

    def __init__(self, tracker: DirtyRowTracker, manifests: list[Manifest], replicated: bool = True,
                 stats: dict[str, float] | None = None, exclude: set[str] | frozenset[str] = frozenset(),
                 stage: bool = False, buffers: Mapping[Key, torch.Tensor] | None = None,
                 sources: Callable[[Manifest], Sequence[RankReport]] | None = None) -> None:
        self._stats = stats  # gets minimal_bytes: the stored bytes of the rows that are applied
        sources = sources or (lambda m: m.ranks)  # the reports that can hold this rank's rows
        breaks: dict[str, set[int]] = {}
        additive = False
        for m in manifests:
            for report in sources(m):
                for table, entry in m.rows_of(report, replicated):
                    breaks.setdefault(table, set()).update(entry.cols)
                    additive = additive or entry.residual
        # A chain with residual entries (quantization.residual) adds up: a row is its newest whole entry
        # plus every newer residual, so the weights start from zero and every entry adds to them.
        self.additive = additive
        # A staged plain chain writes each row once, from its newest copy: it can read and check every byte
        # first (:meth:`check`), and then decode into the live weights in place, with no host copy.
        self.checks_first = stage and not additive
        buffers = buffers or {}
        self.targets = {
            table: [_Target(k, s, sorted(cuts), self.additive, tracker.mc_table(table), stage,
                            buffers.get(shard_key(table, s.rows, s.cols)), fresh=not self.checks_first)
                    for k, s in tracker.shards(table)]
            for table, cuts in breaks.items() if table not in exclude
        }
        if stats is not None:
            stats["staged_copy_bytes"] = stats.get("staged_copy_bytes", 0) + sum(
                t.copy_bytes for ts in self.targets.values() for t in ts)
        # Row-wise state of the checkpoint being applied, to merge: id(target) -> (target, [(state, rows, values,
        # column weight)]).
        self._rowwise: dict[int, tuple[_Target, list[tuple[int, torch.Tensor, torch.Tensor, float]]]] = {}

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

    def plan(self, table: str, entry: TableEntry, load: Any) -> EntryPlan | None:
        """Claims the rows of ``entry`` that this rank's shards still need (reading only its row ids, through
        ``load``). Returns which stored rows to read, or None when there are none."""
        hits = self._hits(table, entry)
        if not hits:
            return None
        n_stored = entry.num_stored
        where = f"{load.payload.file}: table '{table}': "
        offsets = stored_offsets(entry, load, where, load.payload.file)
        if entry.residual and any(not s.rowwise for s in entry.states):
            raise IncompatibleCheckpointError(
                f"table '{table}': a residual entry with per-column optimizer state; residual coding supports "
                "row-wise optimizer state only (EXACT_ROWWISE_ADAGRAD, SGD)")
        whole = closes(entry, load, where, load.payload.file)
        claims = [self._claim(table, entry, t, r, c, offsets, n_stored, whole) for t, r, c in hits]
        needed = torch.zeros(n_stored, dtype=torch.bool)
        for claim in claims:
            for m in (*claim.maps, claim.state_map, claim.mc_map):
                if m is not None:
                    needed |= m >= 0
        sel = _nonzero(needed)
        if not sel.numel():
            return None
        if sel.numel() >= READ_ALL_FRACTION * n_stored:
            # Most rows: read them all as they lie (their groups of rows are read anyway) rather than gather
            # them; the maps skip the others (-1).
            sel = torch.arange(n_stored)
        return EntryPlan(table, entry, claims, sel, self._row_bytes(entry, load.payload.blobs, n_stored))

    def _row_bytes(self, entry: TableEntry, blobs: Mapping[str, Blob], n_stored: int) -> float:
        """Bytes an entry stores per row: its encoded (or float32) row, its optimizer state and its share of
        its group's CRC (ids left out)."""
        if self._stats is None or not n_stored:
            return 0.0
        names = entry.row_blobs + ([entry.checks.blob] if entry.checks is not None else [])
        return sum(blobs[n].nbytes for n in names) / n_stored

    def _claim(self, table: str, entry: TableEntry, target: _Target, row_ov: tuple[int, int],
               col_ov: tuple[int, int], offsets: torch.Tensor | None, n_stored: int,
               whole: bool | torch.Tensor) -> _Claim:
        """Claims, for one shard ``entry`` overlaps, the rows of each column segment and of its row-wise state.
        ``whole``: which stored rows are whole copies (:func:`~cnr_torchrec.ckpt.format.precedence.closes`)."""
        shard = target.shard
        rows = entry.rows
        # Stored rows at entry rows [lo, hi) overlap the shard; entry row o is shard row o + shift.
        lo, hi, shift = row_ov[0] - rows[0], row_ov[1] - rows[0], rows[0] - shard.rows[0]
        segs = [seg for seg in target.segments if col_ov[0] <= seg[0] and seg[1] <= col_ov[1]]
        maps = [target.coverage.claim(seg, offsets, n_stored, lo, hi, shift, closes=whole) for seg in segs]
        with_states = bool(entry.states)
        if with_states and len(target.states) != len(entry.states):
            log.warning("table '%s': checkpoint has %d optimizer states, the model %d; states not restored",
                        table, len(entry.states), len(target.states))
            with_states = False
        state_map, weight = None, 1.0
        if with_states and any(s.rowwise for s in entry.states):
            target.has_rowwise = True
            weight = (col_ov[1] - col_ov[0]) / (shard.cols[1] - shard.cols[0])
            if weight != 1.0:  # part of the shard's columns: merged at the end of the checkpoint, claimed then
                state_map = claim_rows_(target.state_filled.clone(), offsets, n_stored, lo, hi, shift)
            elif target.state_follows_weights:  # never in an additive chain
                state_map = maps[0]
            else:
                state_map = claim_rows_(target.state_filled, offsets, n_stored, lo, hi, shift)
        mc_map = None
        if target.mc is not None and entry.mc is not None:
            if entry.mc.fields != target.mc.fields:
                raise IncompatibleCheckpointError(
                    f"table '{table}': the checkpoint's managed-collision state has fields {list(entry.mc.fields)}, "
                    f"the model's module {list(target.mc.fields)}; restore with the eviction policy it was saved with")
            assert target.mc_filled is not None  # a target with an MC module keeps its by-row state's claims
            mc_map = claim_rows_(target.mc_filled, offsets, n_stored, lo, hi, shift)
        elif target.mc is not None or entry.mc is not None:
            raise IncompatibleCheckpointError(
                f"table '{table}' is a managed-collision table in the "
                f"{'model' if target.mc is not None else 'checkpoint'} only; restore it onto the same kind of module")
        return _Claim(target, segs, maps, with_states, state_map, weight, mc_map)

    def check(self, plan: EntryPlan, rows: list[torch.Tensor], file: str) -> None:
        """Checks that :meth:`apply` can write ``rows`` as ``plan`` claims them: the codec's layout, and the
        shapes of the weights, optimizer states and managed-collision state (what a file's bytes could get
        wrong beyond their CRCs, which the reader checks). ``rows``: what :meth:`RowReader.check` gives (on
        the meta device where the bytes are checked where they lie and not copied yet).

        Raises:
            CorruptCheckpointError: the rows do not fit the entry's columns (names ``file``).
        """
        entry, n = plan.entry, plan.sel.numel()
        width = entry.cols[1] - entry.cols[0]
        where = f"{file}: table '{plan.table}', the entry for rows [{entry.rows[0]}, {entry.rows[1]})"
        got = [tuple(t.shape) for t in rows]
        want: list[tuple[int, ...]] = [(n, width)]  # a replicated table's rows are stored as they are
        if entry.replicated is None:
            keys = sorted(entry.coded.blobs)
            try:
                encoded = rebuild(dict(zip(keys, rows)), {**entry.coded.meta, "num_rows": n})
            except EncodingFormatError as e:
                raise CorruptCheckpointError(f"{where}: its encoded rows are inconsistent: {e}", path=file) from None
            got = [(n, encoded.dim)] + got[len(keys):]
            want += [(n,) if s.rowwise else (n, width) for s in entry.states]
        if entry.mc is not None:
            want.append((n, len(entry.mc.fields)))
        if len(got) != len(want) or not all(g == w or g == (*w, 1) for g, w in zip(got, want)):
            raise CorruptCheckpointError(
                f"{where}: its stored rows are {got} (weights, optimizer states, managed-collision state) where "
                f"its {width} columns need {want}; the file was edited or crafted: restore another checkpoint "
                "with restore(step=...)", path=file)

    def close_checkpoint(self, plans: Sequence[EntryPlan]) -> None:
        """Ends the claims of one checkpoint whose rows are checked now and applied later (:attr:`checks_first`):
        marks the row-wise states its ``plans`` merge from several column shards (:meth:`finish_checkpoint`
        marks them as it merges them, when each checkpoint is applied as it is read), so that no older
        checkpoint claims them, and updates which shards are done."""
        for plan in plans:
            for claim in plan.claims:
                if claim.state_map is not None and claim.weight != 1.0 and plan.entry.states:
                    rows = claim.state_map.index_select(0, _nonzero(claim.state_map >= 0))
                    claim.target.state_filled[rows] = True
        self.refresh()

    def apply(self, plan: EntryPlan, rows: list[torch.Tensor]) -> None:
        """Writes the rows ``plan`` claimed; ``rows``: the stored rows ``plan.sel`` of each of the entry's
        :attr:`~cnr_torchrec.ckpt.format.manifest.TableEntry.row_blobs`."""
        entry, sel = plan.entry, plan.sel
        m = sel.numel()
        encoded = weights = None
        if entry.replicated is not None:
            weights, saved_states = rows[0].float(), []
        else:
            keys = sorted(entry.coded.blobs)
            try:
                encoded = rebuild(dict(zip(keys, rows)), {**entry.coded.meta, "num_rows": m})
            except EncodingFormatError as e:
                raise CorruptCheckpointError(f"encoded rows of table '{plan.table}' are inconsistent: {e}") from None
            saved_states = rows[len(keys):len(keys) + len(entry.states)]
        states = [(s.rowwise, t) for s, t in zip(entry.states, saved_states)]
        mc_rows = rows[-1] if entry.mc is not None else None
        for claim in plan.claims:
            every = m == entry.num_stored  # every stored row was read: the maps as they are
            maps = [mp if every else mp.index_select(0, sel) for mp in claim.maps]
            state_map = claim.state_map
            if state_map is not None and not every:
                state_map = state_map.index_select(0, sel)
            self._write(claim, entry, maps, state_map, encoded, weights, states if claim.with_states else [])
            if claim.mc_map is not None:
                mc_map = claim.mc_map if every else claim.mc_map.index_select(0, sel)
                assert claim.target.mc_state is not None and mc_rows is not None  # claimed: both sides hold it
                scatter_rows_(claim.target.mc_state, mc_map, mc_rows)
            if self._stats is not None:
                width = entry.cols[1] - entry.cols[0]
                applied = sum(np.count_nonzero(mp.numpy() >= 0) * (seg[1] - seg[0]) / width
                              for seg, mp in zip(claim.segs, maps))
                self._stats["minimal_bytes"] = self._stats.get("minimal_bytes", 0) + round(applied * plan.row_bytes)

    def _write(self, claim: _Claim, entry: TableEntry, maps: list[torch.Tensor], state_map: torch.Tensor | None,
               encoded: EncodedRows | None, weights: torch.Tensor | None,
               states: list[tuple[bool, torch.Tensor]]) -> None:
        """Decodes (or copies) one claim's rows into its shard, with their optimizer state."""
        target, segs, cols = claim.target, claim.segs, entry.cols
        shard = target.shard
        with torch.no_grad():
            if encoded is not None and len(segs) == 1 and segs[0] == cols:
                # One segment spanning the stored columns (the usual case): decode straight into place, or onto
                # it in an additive chain (the decoded row, then one rounded add: the bits of the path below).
                codec_for(encoded).decode_into(encoded, target.columns(target.weights, segs[0]), maps[0],
                                               accumulate=self.additive)
            else:
                # Some segments of the stored columns: decode the rows any segment needs, once, then write (or
                # add) them.
                needed = maps[0] >= 0
                for mp in maps[1:]:
                    needed |= mp >= 0
                sel = _nonzero(needed)
                if sel.numel():
                    if weights is not None:
                        vals = weights.index_select(0, sel)
                    else:
                        assert encoded is not None  # an entry holds its rows encoded, or whole (replicated)
                        vals = decode(encoded.take(sel))
                    put = self._add if self.additive else self._scatter
                    for seg, mp in zip(segs, maps):
                        put(target, target.weights, seg, cols, mp.index_select(0, sel), vals)
            for j, (rowwise, saved) in enumerate(states):
                if not rowwise:  # per-column state: where the weights went
                    live = target.states[j].reshape(shard.num_rows, -1)
                    for seg, mp in zip(segs, maps):
                        self._scatter(target, live, seg, cols, mp, saved)
        rowwise_states = [(j, saved) for j, (rw, saved) in enumerate(states) if rw]
        if rowwise_states:
            assert state_map is not None  # the claim took the entry's row-wise state with its rows
            self._apply_rowwise(claim, state_map, rowwise_states)

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

    def _apply_rowwise(self, claim: _Claim, index: torch.Tensor, rowwise: list[tuple[int, torch.Tensor]]) -> None:
        """Row-wise optimizer state (one value per row of a column shard), merged by column overlap.

        ``index``: the shard row of each stored row read (-1: not this shard's to write).
        """
        target = claim.target
        if claim.weight == 1.0:  # the entry spans the shard's columns: its value is the value
            with torch.no_grad():
                for j, saved in rowwise:
                    live = target.states[j].reshape(target.shard.num_rows, 1)
                    scatter_rows_(live, index.to(live.device), saved.to(live).view(-1, 1))
            return
        # Part of the shard's columns: collect, and merge at the end of the checkpoint (claimed then).
        src = _nonzero(index >= 0)
        dst = index.index_select(0, src)
        for j, saved in rowwise:
            self._rowwise.setdefault(id(target), (target, []))[1].append(
                (j, dst, saved.index_select(0, src).float(), claim.weight))

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
        self.refresh()

    def refresh(self) -> None:
        """Updates which shards are done (every row closed, with its states), for :meth:`done`."""
        for ts in self.targets.values():
            for t in ts:
                if not t.done:
                    t.refresh()

    def check_complete(self, tracker: DirtyRowTracker, baseline: Manifest, tables: Sequence[str]) -> None:
        """Once the whole chain down to ``baseline`` is applied: every row of every shard of ``tables`` (those
        this rank restores from the chain) has had a whole copy. A chain without one (a baseline that lacks a
        table's entries, a table listed replicated that no part stores, entries moved off their rank's shard)
        would leave those rows as the model held them: refused instead.

        Raises:
            CorruptCheckpointError: rows of a table have no copy in the chain (names the table and a row).
        """
        for table in tables:
            targets = self.targets.get(table)
            if targets is None:  # no entry of the chain touches the table
                shard = next((s for _, s in tracker.shards(table) if s.num_rows), None)
                if shard is not None:
                    raise _uncovered(baseline, table, shard, shard.rows[0])
                continue
            for t in targets:
                for mask in t.filled.values():
                    if not _all(mask):
                        raise _uncovered(baseline, table, t.shard, t.shard.rows[0] + int(_nonzero(~mask)[0]))

    def finish(self) -> StagedWeights:
        """Gives each managed-collision module the by-row state the chain restored (its sorted buffers rebuilt).
        Returns the weights restored into host copies (``stage``), which reach the shards at their commit."""
        for t in (t for ts in self.targets.values() for t in ts):
            if t.mc is not None and t.mc_state is not None:
                t.mc.load_by_row(t.mc_state)
            t.fill_staged()
        return StagedWeights([(t.key, t.live, t.weights) for ts in self.targets.values() for t in ts
                              if t.live is not None])


def _uncovered(baseline: Manifest, table: str, shard: Any, row: int) -> CorruptCheckpointError:
    path = manifest_path(baseline.id)
    return CorruptCheckpointError(
        f"{path}: the chain on checkpoint {baseline.id} holds no copy of row {row} of table '{table}' (this rank's "
        f"shard: rows {list(shard.rows)}, columns {list(shard.cols)}); a restore would leave it as the model holds "
        "it. The checkpoint was edited, crafted or half copied; restore another with restore(step=...)", path=path)


def _all(mask: torch.Tensor) -> bool:
    """Whether every entry of a 1-D CPU bool mask is set (numpy's all: 20x torch's here)."""
    return bool(mask.numpy().all())


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the set entries of a 1-D CPU bool mask (numpy's flatnonzero: 9x torch.nonzero here)."""
    return torch.from_numpy(np.flatnonzero(mask.numpy()))
