"""The host copies a restore writes float32 host shards into, which reach the model only at its commit.

A restore that must be able to fail without a trace (``restore_rollback``) writes no float32 host shard
before every rank has succeeded (:meth:`StagedWeights.commit`). A residual chain adds its copies up into a
host copy of each shard, which it copies into the live weights then: the rows a residual job keeps anyway
(its reconstruction, which the restore borrows and which becomes the restored rows again; the caller
passes those as buffers by shard key), else new memory. A plain chain reads and checks every byte it will
apply first, and decodes into the live weights only at the commit (a shard with a buffer is still staged
into it, which costs nothing and gives the reconstruction its rows). Other shards (on a GPU, of another
dtype) are written in place, and the rollback's snapshot copies them beforehand instead (:mod:`.rollback`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from cnr_torchrec.ckpt.format.blocks import ShardKey, shard_key
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["Key", "StagedWeights", "can_stage", "fits", "host_copy", "stageable_weights"]

Key = ShardKey
"""A shard: (table, global rows, global columns)."""


def can_stage(weights: torch.Tensor) -> bool:
    """Whether a shard's weights are restored into a host copy first when a restore stages (float32 on the
    host: the copy is the residual reconstruction's too). Others are written in place, and a restore that
    must be able to fail without a trace copies them beforehand instead (restore/rollback.py)."""
    return weights.device.type == "cpu" and weights.dtype == torch.float32


def host_copy(weights: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """The copy a staged restore writes ``weights``' rows into: ``buffer`` where it fits, else new memory
    (unwritten: the restore writes or zeroes what it needs)."""
    return buffer if buffer is not None and fits(buffer, weights) else torch.empty_like(weights)


def fits(buffer: torch.Tensor | None, weights: torch.Tensor) -> bool:
    """Whether ``buffer`` can hold a staged copy of ``weights``."""
    return (buffer is not None and buffer.shape == weights.shape and buffer.dtype == weights.dtype
            and buffer.device == weights.device and buffer.is_contiguous())


def stageable_weights(tracker: DirtyRowTracker) -> Iterator[tuple[Key, torch.Tensor]]:
    """(key, weights) of every local shard a staged restore copies to the host first (:func:`can_stage`)."""
    for table in tracker.tables():
        for kernel, shard in tracker.shards(table):
            weights = kernel.tbe.split_embedding_weights()[shard.local_index]
            if can_stage(weights):
                yield shard_key(table, shard.rows, shard.cols), weights


class StagedWeights:
    """Shard weights a restore wrote into host copies, or read and checked and has yet to write: nothing reaches
    the model until :meth:`commit`.

    Attributes:
        entries: (shard key ``(table, rows, cols)``, the live weights, the restored copy).
        restored: (shard key, rows equal to its live weights already): shards restored in place from rows the
            caller keeps (a memory image), which :meth:`by_key` gives too.
        pending: the writes a plain chain's restore left for the commit (rows read and checked already, decoded
            into the live weights in place: :func:`~cnr_torchrec.ckpt.restore.chain.restore_chain`); it
            returns the shards it staged into host copies besides (those with a buffer), to copy in as
            ``entries``. None: nothing left to write but ``entries``.
    """

    def __init__(self, entries: list[tuple[Key, torch.Tensor, torch.Tensor]],
                 restored: list[tuple[Key, torch.Tensor]] | None = None,
                 pending: Callable[[], StagedWeights] | None = None) -> None:
        self.entries = entries
        self.restored = restored or []
        self.pending = pending

    def commit(self) -> None:
        """Writes what is pending, then copies every restored shard into the live weights. Once only."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.entries = self.entries + pending().entries
        with torch.no_grad():
            for _, live, rows in self.entries:
                live.copy_(rows)

    def by_key(self) -> dict[Key, torch.Tensor]:
        """The restored float32 rows of each shard staged into a host copy or restored from rows the caller keeps,
        by key (what a residual reconstruction starts from); complete once committed."""
        return {**dict(self.restored), **{key: rows for key, _, rows in self.entries}}
