"""Restore: apply a baseline and its deltas to whatever shards this rank holds now.

Every stored entry carries the global row range and column range of the shard that
wrote it, and its rows carry offsets into that range. A rank therefore reads only the
entries that overlap its current shards and writes the overlapping rows and columns
into its TBE views (decoded in place, or written by ``torch.ops.cnr.scatter_rows_``,
``index_copy_`` by whole rows), whatever the world size and plan were at save time.
The chain is applied newest checkpoint first, and a row already restored from a newer
checkpoint is skipped (``torch.ops.cnr.claim_rows_``), so each row is decoded and
written once; the walk stops early once every row is restored.
Row-wise optimizer state (one value per row of a column shard) is mapped by
column overlap: when a shard now spans columns that several shards held, its value is
their column-weighted mean, which is exact for row-wise Adagrad's mean of squared
gradients whenever the new shard is a union of old ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from cnr_torchrec.ckpt.format.chunks import IOPool, PayloadReader
from cnr_torchrec.ckpt.format.dense_optim import load_named_state
from cnr_torchrec.ckpt.format.manifest import Manifest, TableEntry
from cnr_torchrec.ckpt.format.payload import unflatten_state
from cnr_torchrec.ckpt.format.state import decode_ids, dense_named_state, non_persistent_buffers, set_rng_state
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.errors import CnrError, CorruptCheckpointError, IncompatibleCheckpointError
from cnr_torchrec.ops import claim_rows_, scatter_rows_
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, codec_for, decode
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.track.tbe_cache import invalidate_caches

__all__ = ["check_compatible", "check_model", "restore_chain", "restore_dense_optimizer"]

log = logging.getLogger(__name__)


def check_compatible(manifest: Manifest, tracker: DirtyRowTracker) -> None:
    """Raises IncompatibleCheckpointError if the checkpoint's tables differ from the model's."""
    saved = manifest.tables
    have = set(tracker.tables())
    missing, extra = sorted(have - set(saved)), sorted(set(saved) - have)
    if missing or extra:
        raise IncompatibleCheckpointError(
            f"checkpoint {manifest.id} is of another model: tables missing from it {missing}, tables the model "
            f"lacks {extra}. Restore a checkpoint of this model, or start from scratch with a new root."
        )
    for table in sorted(have):
        shape = tracker.table_shape(table)
        if shape is not None and list(shape) != list(saved[table]):
            raise IncompatibleCheckpointError(
                f"table '{table}' is {shape[0]} x {shape[1]} in the model but {saved[table][0]} x {saved[table][1]} "
                f"in checkpoint {manifest.id}; the model changed shape since it was saved"
            )


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def check_model(target: Manifest, model_tables: Mapping[str, list[int]], model: nn.Module,
                tracker: DirtyRowTracker) -> None:
    """IncompatibleCheckpointError, on every rank alike, if ``target`` is of another model than ``model``, whose
    tables have the shapes ``model_tables`` (the whole model's, gathered from every rank)."""
    saved = target.tables
    missing, extra = sorted(set(model_tables) - set(saved)), sorted(set(saved) - set(model_tables))
    changed = [f"'{t}' is {model_tables[t][0]} x {model_tables[t][1]} in the model but {saved[t][0]} x "
               f"{saved[t][1]} in the checkpoint" for t in sorted(set(saved) & set(model_tables))
               if model_tables[t] and list(saved[t]) != model_tables[t]]
    first = target.ranks[0]
    dense = {n: list(t.shape) for n, t in dense_named_state(model, tracker.module_fqns()).items()}
    stored = {n: list(first.blobs[b].shape) for n, b in first.dense.items()}
    changed += [f"dense parameter '{n}' is {shape} in the model but {stored[n]} in the checkpoint"
                for n, shape in sorted(dense.items()) if n in stored and list(stored[n]) != shape]
    lacking = sorted(set(dense) - set(stored) - non_persistent_buffers(model))
    if missing or extra or changed or lacking:
        what = "; ".join(filter(None, [
            missing and f"tables missing from it {missing}", extra and f"tables the model lacks {extra}",
            lacking and f"dense parameters missing from it {lacking}", *changed]))
        raise IncompatibleCheckpointError(
            f"checkpoint {target.id} is of another model: {what}. Restore a checkpoint of this model, or "
            "start from scratch with a new root."
        )


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


class _Applier:
    """Applies a chain's entries to this rank's shards, newest checkpoint first.

    For each entry and shard, ``claim_rows_`` maps the entry's stored rows to the shard
    rows that no newer checkpoint restored (-1 for the rest) and marks them restored;
    the rows are then decoded (or copied) straight to their places by that map.
    """

    def __init__(self, tracker: DirtyRowTracker, manifests: list[Manifest], replicated: bool = True) -> None:
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
        states = [(s.rowwise, load(s.blob)) for s in entry.states]
        residual = entry.residual
        if residual and any(not rowwise for rowwise, _ in states):
            raise IncompatibleCheckpointError(
                f"table '{table}': a residual entry with per-column optimizer state; residual coding supports "
                "row-wise optimizer state only (EXACT_ROWWISE_ADAGRAD, SGD)")
        for target, row_ov, col_ov in hits:
            self._apply_one(table, target, rows, cols, row_ov, col_ov, offsets, n_stored, encoded, weights, states,
                            residual)

    def _apply_one(self, table, target, rows, cols, row_ov, col_ov, offsets, n_stored, encoded, weights,
                   states, residual) -> None:
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


def restore_chain(
    manifests: list[Manifest],
    *,
    storage: Storage,
    model: nn.Module,
    tracker: DirtyRowTracker,
    rank: int,
    world_size: int,
    dense_optimizer: Any,
    extra_state: Mapping[str, Any],
    replicated: bool = True,
    stats: dict[str, int] | None = None,
    pool: IOPool | None = None,
) -> None:
    """Applies ``manifests`` (baseline first) to this rank's model state.

    Args:
        replicated: also restore what every rank holds alike: data_parallel tables, dense
            parameters, the dense optimizer and the TBE step counter. Partial recovery
            leaves them out and takes them from a surviving rank instead.
        stats: if given, ``bytes_read`` and ``reads`` (requests) are added to it.
        pool: threads that read the chunks; every file a checkpoint needs is read at once,
            and its entries are decoded as their chunks land.
    """
    target = manifests[-1]
    check_compatible(target, tracker)
    applier = _Applier(tracker, manifests, replicated)
    own: PayloadReader | None = None  # this rank's file of the target, if read: per-rank state is there too
    try:
        for m in reversed(manifests):  # newest first: each row is decoded and copied once
            if applier.done():
                break
            work = []
            for report in m.ranks:
                load = PayloadReader(storage, report.payload, stats, pool=pool)
                if m is target and report.rank == rank:
                    own = load
                todo = [(t, e) for t, e in m.rows_of(report, replicated) if applier.wants(t, e)]
                if todo:
                    load.start()  # every needed file of this checkpoint is read at once
                    work.append((load, todo))
            for load, todo in work:
                for table, entry in todo:
                    applier.apply(table, entry, load)
            applier.finish_checkpoint()
    finally:
        # fused_uvm_caching: the restored rows went to the weights behind the cache, whose lines
        # are stale now (even after a failure part way, when the rows are a mix).
        invalidate_caches(tracker.tbes())

    if replicated:
        _restore_replicated(target, storage, model, tracker, dense_optimizer, stats)
    if target.world_size != world_size or not target.per_rank_state:
        log.warning(
            "checkpoint %d was written by %d ranks and is restored onto %d: embedding rows, dense and optimizer "
            "state are resharded; per-rank state (%s, RNG) is not restored",
            target.id, target.world_size, world_size, ", ".join(sorted(extra_state)) or "no extra_state",
        )
        return
    mine = target.ranks[rank]
    load = own if own is not None and own.has_data else PayloadReader(storage, mine.payload, stats, whole=False)
    unknown = sorted(set(extra_state) - set(mine.extra))
    if unknown:
        raise IncompatibleCheckpointError(
            f"extra_state {unknown} is not in checkpoint {target.id} (it has {sorted(mine.extra)})"
        )
    try:
        for name, obj in extra_state.items():
            obj.load_state_dict(unflatten_state(mine.extra[name], load))
        set_rng_state(unflatten_state(mine.rng, load))
    except CnrError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
        raise CorruptCheckpointError(
            f"{mine.file}: this rank's saved extra_state or RNG state is malformed ({type(e).__name__}: {e}); the "
            f"manifest of checkpoint {target.id} was edited or crafted", path=mine.file) from None


def _restore_replicated(target, storage, model, tracker, dense_optimizer, stats) -> None:
    """Dense parameters, the dense optimizer and the TBE step counter, from rank 0's file of ``target``."""
    first = target.ranks[0]
    load0 = PayloadReader(storage, first.payload, stats, whole=False)  # a few small blobs of rank 0's file
    dense = dense_named_state(model, tracker.module_fqns())
    transient = non_persistent_buffers(model)  # absent from a checkpoint imported from a state_dict: left as is
    dense = {n: t for n, t in dense.items() if n in first.dense or n not in transient}
    missing = sorted(set(dense) - set(first.dense))
    if missing:
        raise IncompatibleCheckpointError(
            f"dense parameters {missing} are not in checkpoint {target.id}; the model's dense part changed"
        )
    with torch.no_grad():
        for name, t in dense.items():
            saved = load0(first.dense[name])
            if saved.shape != t.shape:
                raise IncompatibleCheckpointError(
                    f"dense parameter '{name}' is {list(t.shape)} in the model, {list(saved.shape)} in the checkpoint"
                )
            t.copy_(saved)
    if dense_optimizer is not None:
        restore_dense_optimizer(target, storage, model, dense_optimizer, stats)

    for tbe in tracker.tbes():
        it = getattr(tbe, "iter", None)
        if isinstance(it, torch.Tensor) and it.numel() == 1:
            it.fill_(max(r.tbe_iter for r in target.ranks))


def restore_dense_optimizer(target: Manifest, storage: Storage, model: nn.Module, dense_optimizer: Any,
                            stats: dict[str, int] | None = None) -> None:
    """Only the dense optimizer's state, from rank 0's file of ``target`` (partial recovery needs its layout),
    each parameter's by its name (see dense_optim.py)."""
    first = target.ranks[0]
    if first.dense_optimizer is None:
        raise IncompatibleCheckpointError(
            f"checkpoint {target.id} holds no dense optimizer state; pass dense_optimizer=None to restore it"
        )
    load0 = PayloadReader(storage, first.payload, stats, whole=False)
    saved = unflatten_state(first.dense_optimizer, load0)
    load_named_state(model, dense_optimizer, saved, f"checkpoint {target.id}")
