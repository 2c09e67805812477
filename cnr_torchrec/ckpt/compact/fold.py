"""Compaction of a residual chain: each rank adds up the rows of its regions and writes them as float32.

In a residual chain (``quantization.residual``) a row restores as its newest whole entry plus
every newer residual, so no checkpoint's stored bytes hold the row and the lossless merge of
:mod:`~cnr_torchrec.ckpt.compact.merge` cannot keep them. The fold adds them up instead, newest
checkpoint first and in the order a restore adds them
(:func:`~cnr_torchrec.ckpt.tools.offline.assemble_regions`), and writes each region's sums as
float32 rows (codec ``none``) with the optimizer state the chain stores. Restoring the folded
checkpoint therefore gives, bit for bit, what restoring its chain gives.

A region is assembled and written one at a time, so a rank holds at most its largest region's
float32 rows and states beyond what training holds.

How the job's closed loop carries on across the fold: the delta that hangs on the folded
baseline holds the rows dirty since the compaction's tip, coded as residuals against the tip's
reconstruction (:class:`~cnr_torchrec.ckpt.save.residual.Reconstruction` keeps the tip's values of
the rows that change after it), which is what the fold holds for them: the residuals the job wrote
for them after the tip are not in the new chain. Every other row's reconstruction is still the tip's.
"""

from __future__ import annotations

import time
from typing import Any

from cnr_torchrec.ckpt.compact.merge import compacted_report, none_rows
from cnr_torchrec.ckpt.format.chunks import DEFAULT_CHUNK_BYTES, IOPool, PayloadWriter
from cnr_torchrec.ckpt.format.commits import rank_file
from cnr_torchrec.ckpt.format.layout import Region
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport
from cnr_torchrec.ckpt.format.rows import write_rows
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.ckpt.tools.offline import assemble_regions

__all__ = ["FOLDED_CODEC", "fold_rank", "is_residual"]

FOLDED_CODEC = {"method": "none", "bits": None, "params": {}}
"""The codec a folded checkpoint's manifest names: its rows are float32 sums."""


def is_residual(chain: list[Manifest]) -> bool:
    """Whether ``chain`` holds residual entries, so that compacting it needs :func:`fold_rank`."""
    return any(e.residual for m in chain for _, _, e in m.entries())


def fold_rank(
    storage: Storage,
    chain: list[Manifest],
    regions: list[Region],
    *,
    new_id: int,
    rank: int,
    rank_state: RankReport | None,
    dense_state: RankReport | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pool: IOPool | None = None,
) -> dict[str, Any]:
    """Writes this rank's file of ``chain`` folded into checkpoint ``new_id``: each region's rows, summed as a
    restore sums them, as float32 entries. Arguments and returned report: as
    :func:`~cnr_torchrec.ckpt.compact.merge.merge_rank`'s.

    Raises:
        CorruptCheckpointError: a file of the chain fails its checks (names it), or the chain leaves part
            of a region unwritten.
    """
    t0 = time.perf_counter()
    blobs = PayloadWriter(storage, rank_file(new_id, rank), chunk_bytes, pool)
    tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = 0
    for i, region in enumerate(regions):
        data = assemble_regions(storage, chain, [region])[region]
        whole = ((0, region.rows[1] - region.rows[0]), (0, region.cols[1] - region.cols[0]))  # the region's own
        states = [(s.for_shard(*whole).to(s.dtype), s.rowwise) for s in data.states]
        entry: dict[str, Any] = {"rows": list(region.rows), "cols": list(region.cols), "encoding": "full"}
        entry.update(write_rows(blobs, f"f{i}", none_rows(data.weights), states))
        tables.setdefault(region.table, []).append(entry)
        rows_written += region.rows[1] - region.rows[0]
        del data, states  # one region's sums at a time
    return compacted_report(storage, chain, rank, tables, rows_written, rank_state, dense_state, blobs, t0)
