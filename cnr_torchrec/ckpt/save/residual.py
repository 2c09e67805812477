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
    """Per local shard (table, rows, cols), the float32 rows the committed chain restores."""

    def __init__(self) -> None:
        self._rows: dict[Key, torch.Tensor] = {}
        self._pending: list[tuple[Key, torch.Tensor | None, torch.Tensor]] = []

    def reference(self, key: Key, ids: torch.Tensor | None) -> torch.Tensor | None:
        """The reconstruction of rows ``ids`` of shard ``key`` (every row if None); None if unknown."""
        full = self._rows.get(key)
        if full is None:
            return None
        return full if ids is None else full.index_select(0, ids.to(torch.long))

    def stage(self, key: Key, ids: torch.Tensor | None, rows: torch.Tensor, num_rows: int | None = None) -> None:
        """Records that rows ``ids`` of shard ``key`` will restore as ``rows`` once the save commits.

        ``num_rows`` gives the shard's size when ``ids`` is None (a shard written whole).
        """
        if ids is None and num_rows is not None and rows.shape[0] != num_rows:
            raise ValueError(f"shard {key}: {rows.shape[0]} rows staged for a shard of {num_rows}")
        self._pending.append((key, None if ids is None else ids.to(torch.long), rows.float()))

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
            if ids is None:
                self._rows[key] = rows.clone()
            elif key in self._rows:
                self._rows[key].index_copy_(0, ids, rows)
        self._pending.clear()

    def discard(self) -> None:
        """Drops what a failed save staged."""
        self._pending.clear()

    def reset(self, tracker: Any) -> None:
        """Every local shard's reconstruction becomes its current weights (called after a restore)."""
        self._pending.clear()
        self._rows = {}
        for table in tracker.tables():
            for kernel, shard in tracker.shards(table):
                weights = kernel.tbe.split_embedding_weights()[shard.local_index]
                self._rows[(table, tuple(shard.rows), tuple(shard.cols))] = weights.detach().float().cpu().clone()
