"""The DMP layout of a DCP checkpoint: its top-level keys, and how row-wise state splits by column shards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cnr_torchrec.errors import IncompatibleCheckpointError

__all__ = ["MODEL", "OPTIM", "DENSE_OPTIM"]

MODEL, OPTIM, DENSE_OPTIM = "model", "optim", "dense_optim"
"""The top-level keys: ``dmp.state_dict()``, ``dmp.fused_optimizer.state_dict()``, the dense optimizer."""


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
