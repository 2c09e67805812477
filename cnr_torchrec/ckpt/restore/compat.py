"""Whether a checkpoint is of the model a restore would apply it to: tables, shapes and dense parameters.

Restore asks before it changes anything, so that a checkpoint of another model is refused on
every rank alike, with one line that names the first few differences and what to do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.live.dense_params import dense_named_state, non_persistent_buffers
from cnr_torchrec.errors import IncompatibleCheckpointError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["check_compatible", "check_model"]

_SHOWN = 3  # differences named in the message; a model with every table resized would otherwise list them all


def _shape(shape: Sequence[int] | None) -> str:
    return "unknown" if shape is None else " x ".join(map(str, shape))


def _table_differences(saved: Mapping[str, Sequence[int]], model: Mapping[str, Sequence[int] | None]) -> list[str]:
    """Tables only one side has, then tables of another shape (``model`` maps a table to None when its shape is
    unknown here), each in a few words, in a stable order."""
    out = [f"table '{t}' is in the model but not in the checkpoint" for t in sorted(set(model) - set(saved))]
    out += [f"table '{t}' is in the checkpoint but not in the model" for t in sorted(set(saved) - set(model))]
    out += [f"'{t}' is {_shape(model[t])} in the model but {_shape(saved[t])} in the checkpoint"
            for t in sorted(set(saved) & set(model)) if model[t] and list(saved[t] or ()) != list(model[t] or ())]
    return out


def _refuse(ckpt_id: int, differences: list[str]) -> IncompatibleCheckpointError:
    """The error for a checkpoint of another model: one line, the first few differences and the fix."""
    shown = "; ".join(differences[:_SHOWN])
    more = f"; and {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else ""
    return IncompatibleCheckpointError(
        f"checkpoint {ckpt_id} is of another model ({len(differences)} difference(s)): {shown}{more}. Use a new "
        "root, or restore with the model that wrote it"
    )


def check_compatible(manifest: Manifest, tracker: DirtyRowTracker) -> None:
    """Raises IncompatibleCheckpointError if the checkpoint's tables differ from this rank's view of the model."""
    differences = _table_differences(manifest.tables, {t: tracker.table_shape(t) for t in tracker.tables()})
    if differences:
        raise _refuse(manifest.id, differences)


def check_model(target: Manifest, model_tables: Mapping[str, list[int]], model: nn.Module,
                tracker: DirtyRowTracker) -> None:
    """IncompatibleCheckpointError, on every rank alike, if ``target`` is of another model than ``model``, whose
    tables have the shapes ``model_tables`` (the whole model's, gathered from every rank)."""
    differences = _table_differences(target.tables, model_tables)
    first = target.ranks[0]
    dense = {n: list(t.shape) for n, t in dense_named_state(model, tracker.module_fqns()).items()}
    stored = {n: list(first.blobs[b].shape) for n, b in first.dense.items()}
    differences += [f"dense parameter '{n}' is in the model but not in the checkpoint"
                    for n in sorted(set(dense) - set(stored) - non_persistent_buffers(model))]
    differences += [f"dense parameter '{n}' is {shape} in the model but {stored[n]} in the checkpoint"
                    for n, shape in sorted(dense.items()) if n in stored and list(stored[n]) != shape]
    if differences:
        raise _refuse(target.id, differences)
