"""Whether a checkpoint is of the model a restore would apply it to: tables, shapes and dense parameters.

Restore asks before it changes anything, so that a checkpoint of another model is refused with
every difference named, on every rank alike.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.state import dense_named_state, non_persistent_buffers
from cnr_torchrec.errors import IncompatibleCheckpointError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["check_compatible", "check_model"]


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
