"""One committed checkpoint's rows of the served tables, decoded into the changes a follower applies.

A delta stores, per table entry, the rows that changed since its parent: whole copies, or (with
``quantization.residual``) residuals that add onto what the chain restored before. Applied to the float
rows the chain gave until its parent, each changed row becomes what a restore of the delta gives: a whole
copy replaces the row, a residual is added to it, one rounded float32 add per checkpoint, oldest first,
as the chain's one rule says (:mod:`~cnr_torchrec.ckpt.format.precedence`). A managed-collision table's
entry also gives its rows' remapping state (raw id and eviction metadata, by row), stored whole.
Nothing here writes: the changes are staged (:class:`Change`), so that an update that fails part way
leaves the served copy whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport, TableEntry
from cnr_torchrec.ckpt.format.placement import reports_for
from cnr_torchrec.ckpt.format.precedence import closes
from cnr_torchrec.ckpt.format.row_ids import stored_offsets
from cnr_torchrec.errors import CorruptCheckpointError
from cnr_torchrec.quant import EncodingFormatError, decode, rebuild

__all__ = ["Change", "Staged", "read_dense", "reports_serving", "stage_checkpoint"]


@dataclass(frozen=True)
class Change:
    """New float32 values of some rows of a table: ``values[i]`` goes to row ``rows[i]``, columns ``cols``."""

    table: str
    rows: torch.Tensor  # int64 [n], global row ids
    cols: tuple[int, int]
    values: torch.Tensor  # float32 [n, cols[1] - cols[0]]
    mc: torch.Tensor | None = None  # the rows' managed-collision state (int64 [n, len(mc_fields)]), by row
    mc_fields: tuple[str, ...] = ()


def reports_serving(manifest: Manifest, tables: Sequence[str]) -> Sequence[RankReport]:
    """The parts of ``manifest`` that can hold rows of ``tables``: a restore's choice
    (:func:`~cnr_torchrec.ckpt.format.placement.reports_for`) for a reader that holds those tables whole on no
    plan of the job's, so it reads the ranks whose shards overlap them (rank 0 for data_parallel ones), or every
    part, checked together, where the index records no layout."""
    whole = [[t, 0, manifest.tables[t][0], 0, manifest.tables[t][1]] for t in sorted(tables)]
    sharded = manifest.body.get("shards") or {}
    return reports_for(manifest, len(manifest.summaries), whole, any(t not in sharded for t in tables))


@dataclass(frozen=True)
class Staged:
    """What one checkpoint changes: the served tables' rows, and the dense tensors it stores, by name."""

    changes: list[Change]
    dense: dict[str, torch.Tensor]


def stage_checkpoint(storage: Storage, manifest: Manifest, served: Mapping[str, torch.Tensor],
                     dense: Sequence[str] | None = (), stats: dict[str, float] | None = None) -> Staged:
    """What checkpoint ``manifest`` (a delta on what ``served`` holds) changes of the served tables, and its
    dense parameters and buffers ``dense`` (stored whole in rank 0's part in every checkpoint; None: all).

    Args:
        served: each served table's float32 rows as the chain gave them up to the delta's parent (read only).
        stats: gets the payload's ``bytes_read`` and ``reads`` (RowReader's), and the parts' bytes under
            ``part_bytes``.

    Raises:
        CorruptCheckpointError: a part or row fails its checks, or rows do not decode (names the file).
    """
    out = []
    reports = list(reports_serving(manifest, sorted(served)))
    if (dense is None or dense) and all(r.rank != 0 for r in reports):
        reports.insert(0, manifest.ranks[0])
    values: dict[str, torch.Tensor] = {}
    for report in reports:
        load = RowReader(storage, report.payload, stats)
        if stats is not None and manifest.version >= 7:
            stats["part_bytes"] = stats.get("part_bytes", 0) + manifest.body["parts"][report.rank]["nbytes"]
        if report.rank == 0:
            values = read_dense(load, report, dense)
        for table, blob in report.replicated_tables.items():
            if table in served:
                whole = load(blob).float()
                out.append(Change(table, torch.arange(whole.shape[0]), (0, whole.shape[1]), whole.clone()))
        for table, entries in report.tables.items():
            if table in served:
                out += [c for e in entries if (c := _entry_change(table, e, load, served[table], report.file))]
    return Staged(out, values)


def _entry_change(table: str, entry: TableEntry, load: RowReader, rows_before: torch.Tensor,
                  file: str) -> Change | None:
    """What one entry makes of its rows: decoded whole copies, or residuals added onto ``rows_before``."""
    n = entry.num_stored
    if n == 0:
        return None
    where = f"{file}: table '{table}': "
    offsets = stored_offsets(entry, load, where, file)
    whole = closes(entry, load, where, file)
    pick = torch.arange(n)
    parts = load.rows(entry, pick)
    keys = sorted(entry.coded.blobs)
    try:
        encoded = rebuild(dict(zip(keys, parts)), {**entry.coded.meta, "num_rows": n})
    except EncodingFormatError as e:
        raise CorruptCheckpointError(f"{where}encoded rows are inconsistent: {e}", path=file) from None
    values = decode(encoded)
    (r0, _), (c0, c1) = entry.rows, entry.cols
    if values.shape != (n, c1 - c0):
        raise CorruptCheckpointError(f"{where}{list(values.shape)} rows decoded for {n} rows of columns "
                                     f"[{c0}, {c1})", path=file)
    rows = (offsets if offsets is not None else pick) + r0
    mc = (parts[-1], entry.mc.fields) if entry.mc is not None else (None, ())
    if whole is not True:  # residuals add onto the rows below them; rows marked whole replace theirs
        summed = rows_before[rows, c0:c1] + values
        values = summed if whole is False else torch.where(whole.unsqueeze(1), values, summed)
    return Change(table, rows, (c0, c1), values, *mc)



def read_dense(load: RowReader, first: RankReport, names: Sequence[str] | None) -> dict[str, torch.Tensor]:
    """The dense tensors ``names`` (None: all) that rank 0's part ``first`` stores, by name, read by ``load``."""
    stored = first.dense if names is None else [name for name in names if name in first.dense]
    return {name: load(first.dense[name]).clone() for name in stored}
