"""A rank's shards restored from its memory-tier image (:mod:`~cnr_torchrec.ckpt.memory`).

The image holds what the agreed checkpoint restores on this rank, on this layout, to the bit: the
shards' float32 rows, their optimizer states and managed-collision by-row state. Its bytes are checked
against the seal's checksum once, in one of two ways:

- **One pass**, where every shard's weights still wait for their initial values
  (``CheckNRunDMP(will_restore=...)``: a restarted job): there is nothing in them to roll back to, so
  the image is copied straight into the weights and states as it is checksummed, each piece hashed and
  copied while it is in the cache. Bytes that do not match leave the weights to the storage restore that
  follows, which writes every row again (and a restore that fails draws the initial values).
- **Checked, then taken**, otherwise: the checksum first, then float32 host shards are staged as a
  storage restore stages them, with the image's rows as the staged copy (nothing is copied until the
  commit puts them into the live weights); others (on a GPU, of another dtype) are written in place,
  which the rollback's snapshot covers. States go in place, as a storage restore writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from cnr_torchrec.ckpt.format.blocks import shard_key
from cnr_torchrec.ckpt.memory.tier import Candidate, image_tables
from cnr_torchrec.ckpt.restore.host_copies import Key, StagedWeights, can_stage
from cnr_torchrec.deferred_init import DeferredInit
from cnr_torchrec.errors import IncompatibleCheckpointError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["restore_from_image"]


def restore_from_image(image: Candidate, tracker: DirtyRowTracker, stage: bool,
                       deferred: DeferredInit | None = None) -> StagedWeights | None:
    """Every local shard of ``tracker``'s sharded tables (:func:`image_tables`) from ``image`` (by shard key).
    Returns the staged weights (committed by the caller once every rank succeeded; empty unless ``stage``), or
    None if the image's bytes do not match its seal (the caller restores the shards from storage).

    Args:
        deferred: the model's tables whose initial values are not drawn yet: where every shard's are, the image
            is copied in as it is checked, in one pass.

    Raises:
        IncompatibleCheckpointError: the image lacks a shard (its layout was checked against the tracker's when
            it was taken, so this means the model changed since).
    """
    shards = list(_shards(image, tracker))
    if not image.checked:
        into = _one_pass_targets(shards, deferred)
        if into is not None:
            return _copy_in_one_pass(image, shards, into)
        if not image.check():
            return None
    staged = []
    with torch.no_grad():
        for key, kernel, shard, mc, views in shards:
            weights = kernel.tbe.split_embedding_weights()[shard.local_index]
            if stage and can_stage(weights):
                staged.append((key, weights, views.weights))
            else:
                weights.copy_(views.weights)
            for state, view in zip(_live_states(kernel, shard), views.states):
                state.copy_(view.reshape(state.shape))
            if mc is not None and views.mc is not None:
                mc.load_by_row(views.mc.clone())
    out = StagedWeights(staged)
    if not stage:
        out.commit()
    return out


def _shards(image: Candidate, tracker: DirtyRowTracker) -> Iterator[tuple[Key, Any, Any, Any, Any]]:
    """(key, kernel, shard, managed-collision table or None, the image's views) of every shard it restores."""
    for table in image_tables(tracker):
        mc = tracker.mc_table(table)
        for kernel, shard in tracker.shards(table):
            key = shard_key(table, shard.rows, shard.cols)
            views = image.views.get(key)
            if views is None:
                raise IncompatibleCheckpointError(f"the memory image holds no shard {key}; restore from storage")
            yield key, kernel, shard, mc, views


def _live_states(kernel: Any, shard: Any) -> list[torch.Tensor]:
    live = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
    return list(live[shard.local_index]) if live else []


def _one_pass_targets(shards: list[tuple[Key, Any, Any, Any, Any]], deferred: DeferredInit | None
                      ) -> dict[Key, list[torch.Tensor]] | None:
    """Where each shard's regions go in a one-pass restore: its live weights, states and a new by-row state
    tensor; None unless every shard's weights wait for their initial values and every target can take the
    region's bytes as they lie."""
    if deferred is None:
        return None
    into: dict[Key, list[torch.Tensor]] = {}
    for key, kernel, shard, mc, views in shards:
        weights = kernel.tbe.split_embedding_weights()[shard.local_index]
        states = _live_states(kernel, shard)
        targets = [weights, *states]
        regions = [views.weights, *views.states]
        if not (deferred.defers(kernel.tbe) and len(states) == len(views.states)
                and all(_takes(t, r) for t, r in zip(targets, regions))):
            return None
        if mc is not None and views.mc is not None:
            targets.append(torch.empty_like(views.mc))
        into[key] = targets
    return into


def _takes(target: torch.Tensor, region: torch.Tensor) -> bool:
    return (target.device.type == "cpu" and target.dtype == region.dtype and target.is_contiguous()
            and target.numel() == region.numel())


def _copy_in_one_pass(image: Candidate, shards: list[tuple[Key, Any, Any, Any, Any]],
                      into: dict[Key, list[torch.Tensor]]) -> StagedWeights | None:
    with torch.no_grad():
        if not image.copy_checked(into):
            return None
    for key, _, _, mc, views in shards:
        if mc is not None and views.mc is not None:
            mc.load_by_row(into[key][-1])
    # The image's rows equal the weights now: they are what a residual reconstruction keeps.
    return StagedWeights([], restored=[(key, views.weights) for key, _, _, _, views in shards])
