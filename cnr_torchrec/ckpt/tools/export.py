"""``cnr export --format torch``: a checkpoint as a plain, unsharded, full-precision state_dict.

It decodes the chain with the chain assembly of :mod:`cnr_torchrec.ckpt.format.tables`, in one
process, with no model and no process group. (``--format dcp`` is :mod:`cnr_torchrec.ckpt.tools.dcp`.)
"""

from __future__ import annotations

import torch

from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import manifest_path
from cnr_torchrec.ckpt.format.tables import Progress, assemble_tables
from cnr_torchrec.ckpt.tools.checked_chain import load_chain
from cnr_torchrec.ckpt.tools.root import resolve_id
from cnr_torchrec.errors import CorruptCheckpointError

__all__ = ["export_state_dict"]


def export_state_dict(
    storage: Storage, ckpt_id: int | None = None, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """A plain, unsharded, full-precision state_dict of checkpoint ``ckpt_id`` (default: the newest).

    Keys: each table's weight under its unsharded name (``table_fqns``, e.g.
    ``ebc.embedding_bags.t0.weight``), the dense parameters and buffers under their
    names, and each table's fused-optimizer row states under
    ``"<weight name>.optimizer_state.<i>"`` (``[rows]`` for row-wise state, ``[rows, dim]``
    otherwise). The dense optimizer, extra and RNG state are not exported.

    Raises:
        CheckpointNotFoundError: nothing committed, or ``ckpt_id`` is not committed.
        CorruptCheckpointError: a file of the chain fails its checks (names it).
    """
    chain = load_chain(storage, resolve_id(storage, ckpt_id))
    tip = chain[-1]
    tables = assemble_tables(storage, chain, progress)
    fqns = tip.table_fqns
    out: dict[str, torch.Tensor] = {}
    for table in sorted(tables):
        name = fqns.get(table, f"{table}.weight")
        data = tables[table]
        out[name] = data.weights
        for i, s in enumerate(data.states):
            out[f"{name}.optimizer_state.{i}"] = s.per_row() if s.rowwise else s.values
    first = tip.ranks[0]
    load0 = RowReader(storage, first.payload)  # the dense blobs only
    for name, blob in first.dense.items():
        if name in out:
            raise CorruptCheckpointError(
                f"{manifest_path(tip.id)}: dense parameter {name!r} has the name of a table", path=first.file
            )
        out[name] = load0(blob).clone()
    return out
