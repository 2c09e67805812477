"""Residual (closed-loop) coding of delta rows: what the chain restores, kept on the host.

With ``quantization.residual``, a delta stores each row it writes as the codec's image of
``x - r``, where ``r`` is what the chain restores for that row so far, and the row's
reconstruction becomes ``r + decode(encode(x - r))``; or, where that restores the row
closer, whole, as ``decode(encode(x))`` (:mod:`~cnr_torchrec.ckpt.save.coding` picks per row).
A row's error is then the quantization error of its last change (or of the row), not a sum over
its history, and restores stop compounding the codec's error (docs/accuracy.md measures it).
The writer needs ``r`` for the rows it writes, so each rank keeps the reconstruction of its
shards here, in float32:

* a baseline sets every row it writes to its decoded value;
* a residual delta sets the rows it writes to what they restore in their modes;
* a restore sets every row to what it restored (:meth:`Reconstruction.reset`);
* the delta that hangs on a background compaction's fold sets every row to the folded value first
  (:meth:`Reconstruction.hang_on`).

Updates are staged while a save writes and applied only once it has committed
(:meth:`commit`); a save that fails leaves the reconstruction as the last committed chain
restores it, and the next save is a baseline anyway.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cnr_torchrec.ckpt import fault_injection
from cnr_torchrec.ckpt.format.blocks import ShardKey, shard_key
from cnr_torchrec.quant import EncodedRows, decode
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["Reconstruction", "RowBacking"]

Key = ShardKey


class RowBacking(Protocol):
    """Where a reconstruction keeps each shard's rows, and the optimizer state that goes with them: the memory
    tier's image (:mod:`~cnr_torchrec.ckpt.memory.tier`)."""

    def hold(self, key: Key, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (a shard's, any dtype and device) kept in the backing's float32 memory for ``key``, which
        is returned (``rows`` itself when it is that memory already)."""
        ...

    def put_states(self, key: Key, ids: torch.Tensor | None, states: list[torch.Tensor],
                   mc: torch.Tensor | None) -> None:
        """Sets rows ``ids`` (every row if None) of shard ``key``'s optimizer states (as stored) and
        managed-collision by-row state."""
        ...


class Reconstruction:
    """Per local shard (table, rows, cols), the float32 rows the committed chain restores.

    Across a background compaction of the chain (a fold, :mod:`~cnr_torchrec.ckpt.compact.fold`), the
    save that hangs its delta on the folded baseline is told the folded rows (:meth:`hang_on`): it codes
    the rows dirty since the compaction's tip against them, which is what that baseline restores, and once
    it commits every shard's reconstruction is the folded rows plus that delta.

    Every reader of a chain adds a row's copies up oldest first (:mod:`~cnr_torchrec.ckpt.format.precedence`),
    as :meth:`commit` does, so the reconstruction is a restore of the committed chain to the bit.

    Args:
        backing: where the rows are kept (the memory tier's image; None: the process's own memory). With a
            backing the reconstruction also carries each committed save's optimizer state to it
            (:meth:`stage_states`), so that the backing holds what the committed chain restores.
    """

    def __init__(self, backing: RowBacking | None = None) -> None:
        self._backing = backing
        self._rows: dict[Key, torch.Tensor] = {}
        self._pending: list[tuple[Key, torch.Tensor | None, torch.Tensor]] = []
        self._pending_states: list[tuple[Key, torch.Tensor | None, list[torch.Tensor], torch.Tensor | None]] = []
        self._fold: dict[Key, EncodedRows] | None = None  # the folded baseline the next delta hangs on

    def _keep(self, key: Key, rows: torch.Tensor) -> torch.Tensor:
        """A shard's full rows as the reconstruction keeps them: in the backing, or as they are."""
        return rows if self._backing is None else self._backing.hold(key, rows)

    def hang_on(self, folded: dict[Key, EncodedRows]) -> None:
        """The next save's delta hangs on a folded baseline whose rows (this rank's) are ``folded``."""
        self._fold = dict(folded)

    def reference(self, key: Key, ids: torch.Tensor | None, on_fold: bool = False) -> torch.Tensor | None:
        """The reconstruction of rows ``ids`` of shard ``key`` (every row if None); None if unknown.

        ``on_fold``: of the folded baseline the save hangs on (:meth:`hang_on`) instead.
        """
        full = self._folded(key) if on_fold else self._rows.get(key)
        if full is None:
            return None
        return full if ids is None else full.index_select(0, ids.to(torch.long))

    def _folded(self, key: Key) -> torch.Tensor | None:
        encoded = None if self._fold is None else self._fold.get(key)
        return None if encoded is None else decode(encoded).float()

    def stage(self, key: Key, ids: torch.Tensor | None, rows: torch.Tensor, num_rows: int | None = None) -> None:
        """Records that rows ``ids`` of shard ``key`` will restore as ``rows`` once the save commits.

        ``num_rows`` gives the shard's size when ``ids`` is None (a shard written whole).
        """
        if ids is None and num_rows is not None and rows.shape[0] != num_rows:
            raise ValueError(f"shard {key}: {rows.shape[0]} rows staged for a shard of {num_rows}")
        # A float32 ``rows`` is kept as it is: the caller made it for this (a decoded or summed row block).
        self._pending.append((key, None if ids is None else ids.to(torch.long), rows.float()))

    def stage_states(self, key: Key, ids: torch.Tensor | None, states: list[torch.Tensor],
                     mc: torch.Tensor | None) -> None:
        """Records the optimizer states (as stored) and managed-collision by-row state that rows ``ids`` of
        shard ``key`` will restore with once the save commits; kept only by a backing."""
        if self._backing is not None:  # copies: staged tensors go back to the staging buffers once written
            self._pending_states.append((key, None if ids is None else ids.to(torch.long),
                                         [t.clone() for t in states], None if mc is None else mc.clone()))

    def after_commit(self, key: Key) -> torch.Tensor | None:
        """What shard ``key`` will restore once the staged save commits (a copy; None if unknown)."""
        folded = self._folded(key)
        full = folded if folded is not None else self._rows.get(key)
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
        """Applies what the committed save staged (on the folded rows, if it hung on a fold)."""
        if self._fold is not None:
            for key in list(self._fold):
                folded = self._folded(key)
                assert folded is not None  # key is one of the fold's
                self._rows[key] = self._keep(key, folded)
                del self._fold[key]  # one shard's encoded and decoded rows at a time
            self._fold = None
        for i, (key, ids, rows) in enumerate(self._pending):
            if ids is None:
                self._rows[key] = self._keep(key, rows)  # staged rows are this object's own (stage made them)
            elif key in self._rows:
                self._rows[key].index_copy_(0, ids, rows)
            if i == 0 and self._backing is not None:
                fault_injection.hit("image.mid")
        self._pending.clear()
        if self._backing is not None:
            for key, ids, states, mc in self._pending_states:
                self._backing.put_states(key, ids, states, mc)
        self._pending_states.clear()

    def discard(self) -> None:
        """Drops what a failed save staged. The next save is a baseline, so no delta hangs on the fold."""
        self._pending.clear()
        self._pending_states.clear()
        self._fold = None

    def release(self) -> dict[Key, torch.Tensor]:
        """Gives up every shard's rows and returns them, by key (a restore stages into them, so that it needs no
        fresh memory: :meth:`reset` takes them back). Until then the reconstruction knows no row, and a save
        that codes against it must be a baseline."""
        rows, self._rows = self._rows, {}
        self._pending.clear()
        self._pending_states.clear()
        self._fold = None
        return rows

    def reset(self, tracker: DirtyRowTracker, restored: dict[Key, torch.Tensor] | None = None) -> None:
        """Every local shard's reconstruction becomes its current weights (called after a restore).

        Args:
            tracker: the shards.
            restored: float32 host rows a restore staged and committed into the weights, by shard key; taken
                as they are (they equal the weights), so that those shards need no second copy.
        """
        self._pending.clear()
        self._pending_states.clear()
        self._fold = None
        self._rows = {}
        restored = restored or {}
        for table in tracker.tables():
            if tracker.is_data_parallel(table):  # stored whole by every save, never coded against
                continue
            for kernel, shard in tracker.shards(table):
                key = shard_key(table, shard.rows, shard.cols)
                if key in restored:
                    self._rows[key] = self._keep(key, restored[key])
                    continue
                weights = kernel.tbe.split_embedding_weights()[shard.local_index].detach()
                self._rows[key] = (weights.float().cpu().clone() if self._backing is None
                                   else self._backing.hold(key, weights))
