"""Residual (closed-loop) coding of delta rows: what the chain restores, kept on the host.

With ``quantization.residual``, a delta stores each row it writes as the codec's image of
``x - r``, where ``r`` is what the chain restores for that row so far, and the row's
reconstruction becomes ``r + decode(encode(x - r))``. A row's error is then the quantization
error of its last change, not of the whole row, and restores stop compounding the codec's
error (docs/accuracy.md measures it). The writer needs ``r`` for the rows it writes, so each
rank keeps the reconstruction of its shards here, in float32:

* a baseline sets every row it writes to its decoded value;
* a residual delta adds the decoded difference to the rows it writes;
* a restore sets every row to what it restored (:meth:`Reconstruction.reset`).

Updates are staged while a save writes and applied only once it has committed
(:meth:`commit`); a save that fails leaves the reconstruction as the last committed chain
restores it, and the next save is a baseline anyway.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Reconstruction"]

Key = tuple[str, tuple[int, int], tuple[int, int]]


class Reconstruction:
    """Per local shard (table, rows, cols), the float32 rows the committed chain restores.

    While a background compaction is pending it also keeps the rows as they stood at its tip
    (:meth:`stage_tip`): the delta that hangs on the compacted baseline codes the rows dirty since
    the tip against what that baseline holds, which is the tip's reconstruction, not today's.
    Only rows that a save changes after the tip are kept, once each.
    """

    def __init__(self) -> None:
        self._rows: dict[Key, torch.Tensor] = {}
        self._pending: list[tuple[Key, torch.Tensor | None, torch.Tensor]] = []
        self._pending_tip = False  # the staged save is a compaction's tip
        self._pending_end = False  # the staged save hangs on the compacted baseline: the tip's rows are done
        # Rows as they stood at the compaction's tip, where a later save changed them.
        self._at_tip: dict[Key, _TipRows] | None = None

    def reference(self, key: Key, ids: torch.Tensor | None, at_tip: bool = False) -> torch.Tensor | None:
        """The reconstruction of rows ``ids`` of shard ``key`` (every row if None); None if unknown.

        ``at_tip``: as the rows stood when the pending compaction's tip committed (None if there is none).
        """
        full = self._rows.get(key)
        if full is None or (at_tip and self._at_tip is None):
            return None
        rows = full if ids is None else full.index_select(0, ids.to(torch.long))
        if at_tip and key in self._at_tip:
            rows = self._at_tip[key].over(rows.clone() if ids is None else rows, ids)
        return rows

    def stage(self, key: Key, ids: torch.Tensor | None, rows: torch.Tensor, num_rows: int | None = None) -> None:
        """Records that rows ``ids`` of shard ``key`` will restore as ``rows`` once the save commits.

        ``num_rows`` gives the shard's size when ``ids`` is None (a shard written whole).
        """
        if ids is None and num_rows is not None and rows.shape[0] != num_rows:
            raise ValueError(f"shard {key}: {rows.shape[0]} rows staged for a shard of {num_rows}")
        self._pending.append((key, None if ids is None else ids.to(torch.long), rows.float()))

    def stage_tip(self) -> None:
        """The save being written is a compaction's tip: once it commits, keep the rows as they stand then."""
        self._pending_tip = True

    def stage_tip_end(self) -> None:
        """The save being written hangs on the compacted baseline: once it commits, the tip's rows are done."""
        self._pending_end = True

    def after_commit(self, key: Key) -> torch.Tensor | None:
        """What shard ``key`` will restore once the staged save commits (a copy; None if unknown)."""
        full = self._rows.get(key)
        out = None if full is None else full.clone()
        for k, ids, rows in self._pending:
            if k != key:
                continue
            if ids is None:
                out = rows.clone()
            elif out is not None:
                out.index_copy_(0, ids, rows)
        return out

    def commit(self) -> None:
        """Applies what the committed save staged."""
        for key, ids, rows in self._pending:
            if self._at_tip is not None and key in self._rows:
                self._at_tip.setdefault(key, _TipRows(self._rows[key].shape[0])).keep(self._rows[key], ids)
            if ids is None:
                self._rows[key] = rows.clone()
            elif key in self._rows:
                self._rows[key].index_copy_(0, ids, rows)
        self._pending.clear()
        if self._pending_end:
            self.end_tip()
        if self._pending_tip:
            self._at_tip, self._pending_tip = {}, False

    def end_tip(self) -> None:
        """Forgets the compaction's tip (the delta on its baseline committed, or no fold will come)."""
        self._at_tip, self._pending_tip, self._pending_end = None, False, False

    def discard(self) -> None:
        """Drops what a failed save staged. The next save is a baseline, so no fold will hang a delta on the tip."""
        self._pending.clear()
        self.end_tip()

    def reset(self, tracker: Any) -> None:
        """Every local shard's reconstruction becomes its current weights (called after a restore)."""
        self._pending.clear()
        self.end_tip()
        self._rows = {}
        for table in tracker.tables():
            for kernel, shard in tracker.shards(table):
                weights = kernel.tbe.split_embedding_weights()[shard.local_index]
                self._rows[(table, tuple(shard.rows), tuple(shard.cols))] = weights.detach().float().cpu().clone()


class _TipRows:
    """One shard's rows as they stood at a compaction's tip, for the rows changed since: each kept once."""

    def __init__(self, num_rows: int) -> None:
        self.slot = torch.full((num_rows,), -1, dtype=torch.int32)  # where row r's tip value is kept (-1: not)
        self.parts: list[torch.Tensor] = []
        self.count = 0

    def keep(self, full: torch.Tensor, ids: torch.Tensor | None) -> None:
        """Keeps the current values of rows ``ids`` (all if None) of ``full`` not kept yet: they are the tip's."""
        idx = torch.arange(full.shape[0]) if ids is None else ids
        new = idx[self.slot.index_select(0, idx) < 0]
        if new.numel():
            self.slot[new] = torch.arange(self.count, self.count + new.numel(), dtype=torch.int32)
            self.parts.append(full.index_select(0, new))
            self.count += new.numel()

    def over(self, rows: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """``rows`` (the current values of rows ``ids``, all if None) with the kept ones put back as at the tip."""
        if not self.parts:
            return rows
        idx = torch.arange(rows.shape[0]) if ids is None else ids.to(torch.long)
        where = self.slot.index_select(0, idx).long()
        was = where >= 0
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts)]
        rows[was] = self.parts[0].index_select(0, where[was])
        return rows
