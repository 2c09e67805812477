"""The DMP layout of a DCP checkpoint: the model's keys at the top level and the rest under named keys, the
older layout that nested the model under ``model``, and how row-wise state splits by column shards."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from cnr_torchrec.errors import IncompatibleCheckpointError

__all__ = ["OPTIM", "DENSE_OPTIM", "TRAIN_STATE", "LEGACY_MODEL", "STEP_PATHS", "RESERVED", "check_model_keys"]

OPTIM, DENSE_OPTIM, TRAIN_STATE = "optim", "dense_optim", "train_state"
"""The named keys beside the model's: ``dmp.fused_optimizer.state_dict()``, the dense optimizer by parameter FQN,
and ``{"step": N}`` (torchtitan's name and shape for it)."""

LEGACY_MODEL = "model"
"""Where earlier versions, and the docs they came with, nested ``dmp.state_dict()``. ``import-dcp`` still reads
it."""

STEP_PATHS: tuple[tuple[str, ...], ...] = (("step",), (TRAIN_STATE, "step"), ("trainer", "step"))
"""Where ``import-dcp`` looks for the training step, in this order."""

RESERVED = (OPTIM, DENSE_OPTIM, TRAIN_STATE, "trainer", "step")
"""Top-level names that a model key may neither be nor begin with (followed by a dot): DCP flattens the named
entries to ``<name>.<...>`` keys, beside the model's own."""


def check_model_keys(keys: Iterable[str], where: str) -> None:
    """Refuses model keys that would mix with the named entries of the layout.

    Raises:
        IncompatibleCheckpointError: a key is a name of :data:`RESERVED` or begins with one and a dot.
    """
    clash = sorted(k for k in keys if k.split(".", 1)[0] in RESERVED)
    if clash:
        raise IncompatibleCheckpointError(
            f"{where}: the model's keys {clash[:5]} would mix with the top-level entries {list(RESERVED)} that a "
            "DCP export keeps beside the model's keys; rename that module, or export with --format torch")


def _column_shards(boxes: Sequence[tuple[Any, Any]], rows: int, dim: int, k: int, what: str) -> list[tuple[int, int]]:
    """The column ranges of the ``k`` column shards of a weight whose shards (offsets, sizes) are ``boxes``, in
    column order (TorchRec's order of row-wise state). IncompatibleCheckpointError for other layouts."""
    if k == 1:
        return [(0, dim)]
    cols = sorted({(int(o[1]), int(o[1]) + int(s[1])) for o, s in boxes})
    if len(cols) != k or any(int(o[0]) != 0 or int(s[0]) != rows for o, s in boxes):
        raise IncompatibleCheckpointError(f"{what}: row-wise state of {k} column shards, but the weight's shards are "
                                          f"{[(list(o), list(s)) for o, s in boxes]}; only column-wise layouts (every "
                                          "shard spanning all rows) split row-wise state by columns")
    return cols
