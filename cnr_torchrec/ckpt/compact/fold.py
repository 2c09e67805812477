"""Compaction of a residual chain: each rank adds up the rows of its regions and writes them at 8 bits.

In a residual chain (``quantization.residual``) a row restores as its newest whole entry plus
every newer residual, so no checkpoint's stored bytes hold the row and the lossless merge of
:mod:`~cnr_torchrec.ckpt.compact.merge` cannot keep them. The fold adds them up instead, in the order
a restore adds them, oldest copy first (:func:`~cnr_torchrec.ckpt.format.tables.assemble_regions`),
and writes each region's sums with the optimizer state the chain stores. Data-parallel tables,
which saves store exact, stay float32. A background compaction writes the other sums with
:data:`FOLDED_CODEC`, adaptive 8-bit, so its folded baseline restores each row's sum within an
8-bit step of the row's range, not bit for bit: float32 sums would be exact, but a float32
baseline is as large as a full snapshot. ``cnr compact``, which no job follows, writes them in
float32 (:data:`LOSSLESS_CODEC`).

How the job's closed loop carries on across the fold: the rank keeps the encoded rows it wrote
(``keep``), and the job's reconstruction moves to them when the delta that hangs on the folded
baseline commits (:meth:`~cnr_torchrec.ckpt.save.residual.Reconstruction.hang_on`). That delta
holds the rows dirty since the compaction's tip, coded as residuals against the folded values,
which is what the baseline restores for them; every other row restores as the folded value, and
that is what its reconstruction becomes.

A region is assembled and written one at a time, so a rank holds at most its largest region's
float32 rows and states beyond what training holds, plus the encoded rows it keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cnr_torchrec.ckpt.compact.merge import CompactedFile, compacted_report
from cnr_torchrec.ckpt.format.blocks import Region, ShardKey, shard_key
from cnr_torchrec.ckpt.format.bytes.rows import write_rows
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.tables import assemble_regions
from cnr_torchrec.ckpt.format.writing import codec_description, table_entry
from cnr_torchrec.ckpt.save.coding import encode_in_blocks
from cnr_torchrec.quant import EncodedRows, get_codec

__all__ = ["FOLDED_CODEC", "LOSSLESS_CODEC", "Key", "fold_rank", "is_residual"]

FOLDED_CODEC = codec_description("adaptive", 8, {}, with_setting=False)
"""The codec a background compaction writes a folded checkpoint's rows with (its manifest names it)."""
LOSSLESS_CODEC = codec_description("none", None, {}, with_setting=False)
"""float32 sums: ``cnr compact``'s fold, which restores bit for bit what the chain restores."""

Key = ShardKey
"""A region as the reconstruction names a shard: (table, rows, cols)."""


def is_residual(chain: list[Manifest]) -> bool:
    """Whether ``chain`` holds residual entries, so that compacting it needs :func:`fold_rank`."""
    return any(e.residual for m in chain for _, _, e in m.entries())


def fold_rank(
    storage: Storage,
    chain: list[Manifest],
    regions: list[Region],
    out: CompactedFile,
    *,
    codec: dict[str, Any] = FOLDED_CODEC,
    keep: Callable[[Key, EncodedRows], None] | None = None,
) -> dict[str, Any]:
    """Writes this rank's file ``out`` of ``chain`` folded into checkpoint ``out.new_id``: each region's rows,
    summed as a restore sums them, encoded by ``codec`` (:data:`FOLDED_CODEC` or :data:`LOSSLESS_CODEC`).
    Arguments and returned report: as :func:`~cnr_torchrec.ckpt.compact.merge.merge_rank`'s; ``keep`` is handed
    each region's encoded rows.

    Raises:
        CorruptCheckpointError: a file of the chain fails its checks (names it), or the chain leaves part
            of a region unwritten.
    """
    t0 = time.perf_counter()
    blobs = out.writer(storage)
    tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = 0
    encoder = get_codec(codec["method"], codec["bits"], **codec["params"])
    exact = get_codec(LOSSLESS_CODEC["method"], LOSSLESS_CODEC["bits"])
    replicated = {t for m in chain for t in m.replicated}  # data_parallel tables, stored whole and exact
    for i, region in enumerate(regions):
        data = assemble_regions(storage, chain, [region])[region]
        whole = ((0, region.rows[1] - region.rows[0]), (0, region.cols[1] - region.cols[0]))  # the region's own
        states = [(s.for_shard(*whole).to(s.dtype), s.rowwise) for s in data.states]
        encoded = encode_in_blocks(exact if region.table in replicated else encoder, data.weights)
        entry = table_entry(region.rows, region.cols, "full",
                            write_rows(blobs, f"f{i}", encoded, states, data.mc_rows(whole[0])))
        if keep is not None:
            keep(shard_key(region.table, region.rows, region.cols), encoded)
        tables.setdefault(region.table, []).append(entry)
        rows_written += region.rows[1] - region.rows[0]
        del data, states, encoded  # one region's sums at a time
    return compacted_report(storage, chain, out, tables, rows_written, blobs, t0)
