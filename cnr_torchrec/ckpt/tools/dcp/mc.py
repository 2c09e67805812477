"""Managed-collision (sort-zch) buffers in a DMP's DCP checkpoint: TorchRec's names for them, and the by-row
state they hold.

A sharded ``MCHManagedCollisionModule`` saves, under
``<module>._managed_collision_collection._managed_collision_modules.<table>``, its sorted buffers as
ShardedTensors of the table's rows (one chunk per rank's slots, by sort position): ``_mch_sorted_raw_ids``,
``_mch_remapped_ids_mapping`` (the global row of each position) and the policy's metadata
(``_mch_counts``, ``_mch_last_access_iter``); and, whole on every rank, ``_current_iter_tensor`` and
``_output_segments_tensor``. Since the mapping holds global rows, the by-row state of the whole table is
the buffers scattered by it, whatever the number of ranks that wrote them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from cnr_torchrec.errors import IncompatibleCheckpointError

__all__ = ["MC_KEY", "buffer_of", "by_row", "fresh_window", "mc_prefix"]

MC_KEY = re.compile(r"^(?P<module>.+)\._managed_collision_collection\._managed_collision_modules\."
                    r"(?P<table>[^.]+)\.(?P<buffer>_[A-Za-z_]+)$")
METADATA = ("counts", "last_access_iter")  # in the order every TorchRec policy keeps them
SEGMENTS = 1025  # TorchRec's _output_segments_tensor: up to 1024 shards' starts and the end, -1 after


def mc_prefix(module: str, table: str) -> str:
    return f"{module}._managed_collision_collection._managed_collision_modules.{table}"


def buffer_of(field: str) -> str:
    """The sorted buffer of a by-row field (``raw_id``, ``mapping`` or a metadata name)."""
    return {"raw_id": "_mch_sorted_raw_ids", "mapping": "_mch_remapped_ids_mapping"}.get(field, f"_mch_{field}")


def fields_of(buffers: dict[str, Any]) -> tuple[str, ...]:
    """The by-row fields a module with these saved buffers has."""
    return ("raw_id", *(f for f in METADATA if buffer_of(f) in buffers))


def by_row(buffers: dict[str, torch.Tensor], rows: int, where: str) -> torch.Tensor:
    """The by-row state (int64 ``[rows, fields]``) of a table from its sorted buffers, whole.

    Raises:
        IncompatibleCheckpointError: a buffer missing or not int64 ``[rows]``, or a mapping that is not a
            permutation of the rows.
    """
    fields = fields_of(buffers)
    for field in (*fields, "mapping"):
        t = buffers.get(buffer_of(field))
        if t is None or t.dtype != torch.int64 or tuple(t.shape) != (rows,):
            raise IncompatibleCheckpointError(f"{where}: {buffer_of(field)} must be int64 [{rows}], one per row")
    mapping = buffers[buffer_of("mapping")]
    if not torch.equal(torch.sort(mapping).values, torch.arange(rows)):
        raise IncompatibleCheckpointError(f"{where}: _mch_remapped_ids_mapping is not a permutation of the "
                                          f"table's {rows} rows")
    state = torch.empty(rows, len(fields), dtype=torch.int64)
    state[mapping] = torch.stack([buffers[buffer_of(f)] for f in fields], dim=1)
    return state


def fresh_window(fields: tuple[str, ...], iteration: int) -> dict[str, Any]:
    """The eviction window of a module loaded from a state_dict, which holds none: empty, at ``iteration``
    (as TorchRec's own load leaves it: the next training step starts a window)."""
    history = ("last_access_iter",) if "last_access_iter" in fields else ()
    return {"current_iter": -1, "iter_tensor": int(iteration), "last_eviction_iter": -1, "history_size": -1,
            "history": torch.empty(0, dtype=torch.int64),
            "history_metadata": {h: torch.empty(0, dtype=torch.int64) for h in history},
            "pending": torch.empty(0, dtype=torch.int64), "evicted": False}
