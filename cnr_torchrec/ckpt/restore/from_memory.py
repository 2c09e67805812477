"""A rank's shards restored from its memory-tier image (:mod:`~cnr_torchrec.ckpt.memory`).

The image holds what the agreed checkpoint restores on this rank, on this layout, to the bit: the
shards' float32 rows, their optimizer states and managed-collision by-row state. Float32 host
shards are staged as a storage restore stages them, with the image's rows as the staged copy
(nothing is copied until the commit puts them into the live weights); others (on a GPU, of another
dtype) are written in place, which the rollback's snapshot covers. States go in place, as a storage
restore writes them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cnr_torchrec.ckpt.format.blocks import shard_key
from cnr_torchrec.ckpt.memory.image import ShardViews
from cnr_torchrec.ckpt.memory.tier import image_tables
from cnr_torchrec.ckpt.restore.host_copies import Key, StagedWeights, can_stage
from cnr_torchrec.errors import IncompatibleCheckpointError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["restore_from_image"]


def restore_from_image(image: Mapping[Key, ShardViews], tracker: DirtyRowTracker, stage: bool) -> StagedWeights:
    """Every local shard of ``tracker``'s sharded tables (:func:`image_tables`) from ``image`` (by shard key).
    Returns the staged weights (committed by the caller once every rank succeeded; empty unless ``stage``).

    Raises:
        IncompatibleCheckpointError: the image lacks a shard (its layout was checked against the tracker's when
            it was taken, so this means the model changed since).
    """
    staged = []
    with torch.no_grad():
        for table in image_tables(tracker):
            mc = tracker.mc_table(table)
            for kernel, shard in tracker.shards(table):
                key = shard_key(table, shard.rows, shard.cols)
                views = image.get(key)
                if views is None:
                    raise IncompatibleCheckpointError(f"the memory image holds no shard {key}; restore from storage")
                weights = kernel.tbe.split_embedding_weights()[shard.local_index]
                if stage and can_stage(weights):
                    staged.append((key, weights, views.weights))
                else:
                    weights.copy_(views.weights)
                live = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
                for state, view in zip(list(live[shard.local_index]) if live else [], views.states):
                    state.copy_(view.reshape(state.shape))
                if mc is not None and views.mc is not None:
                    mc.load_by_row(views.mc.clone())
    out = StagedWeights(staged)
    if not stage:
        out.commit()
    return out
