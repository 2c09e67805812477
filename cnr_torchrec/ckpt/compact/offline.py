"""``cnr compact``: a chain merged into one new baseline, offline, by one process. It must not run while a job
writes to the same root.

It is lossless by default: it keeps every row's stored bytes (:mod:`cnr_torchrec.ckpt.compact.merge`,
which the background compaction uses too), in the tip's own layout. Given a codec it decodes the chain
with the chain assembly of :mod:`cnr_torchrec.ckpt.format.tables` and encodes the rows again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from cnr_torchrec.ckpt.compact.background import compacted_body
from cnr_torchrec.ckpt.compact.fold import LOSSLESS_CODEC, fold_rank, is_residual
from cnr_torchrec.ckpt.compact.merge import CompactedFile, copy_blob, copy_blob_tree, merge_rank
from cnr_torchrec.ckpt.format.blocks import regions_of_layout
from cnr_torchrec.ckpt.format.bytes.chunks import DEFAULT_CHUNK_BYTES, PayloadReader, PayloadWriter
from cnr_torchrec.ckpt.format.bytes.payload import DTYPES
from cnr_torchrec.ckpt.format.bytes.rows import write_rows
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    ckpt_dir,
    committed_ids,
    existing_dir_ids,
    manifest_path,
    part_path,
    rank_file,
    seal,
    write_index,
)
from cnr_torchrec.ckpt.format.manifest import Manifest, RankReport
from cnr_torchrec.ckpt.format.parts import with_parts, write_part
from cnr_torchrec.ckpt.format.schema import check_manifest, check_payload
from cnr_torchrec.ckpt.format.tables import Progress, TableData, assemble_tables
from cnr_torchrec.ckpt.format.writing import StateBlobs, WriteCounts, codec_description, rank_report, table_entry
from cnr_torchrec.ckpt.tools.checked_chain import load_chain
from cnr_torchrec.ckpt.tools.root import resolve_id
from cnr_torchrec.errors import CorruptCheckpointError
from cnr_torchrec.quant import get_codec

__all__ = ["compact"]

log = logging.getLogger(__name__)


def compact(
    storage: Storage,
    ckpt_id: int | None = None,
    *,
    method: str | None = None,
    bits: int | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Merges ``ckpt_id``'s chain (default: the newest committed) into a new baseline with the next free id.

    The new checkpoint has the tip's step and world size, and restores what the tip restores
    (``equals`` names the tip). By default (``method=None``) it is lossless: each row keeps the
    stored bytes of the newest checkpoint that holds it (:mod:`cnr_torchrec.ckpt.compact.merge`), or,
    in a residual chain, holds its float32 sums (:mod:`cnr_torchrec.ckpt.compact.fold`), so restoring
    it equals restoring the chain bit for bit, whatever the codec. With a
    ``method``, the chain's rows are decoded and encoded again with that codec in the tip's
    shard layout (their error adds to the chain's own). Either way it copies the tip's dense
    parameters, dense optimizer, extra and RNG state and TBE step.

    Rank files are written first, then the sealed manifest atomically (the commit), then
    index.json: the Checkpointer's protocol. Must not run while a job writes to the root.

    Returns:
        The new checkpoint's manifest.

    Raises:
        CheckpointNotFoundError: nothing committed, or ``ckpt_id`` is not committed.
        CorruptCheckpointError: a file of the chain fails its checks (names it).
        UnknownCodecError: ``method``/``bits`` name no codec.
        CompactionError: the lossless merge meets a row it cannot keep as stored (give a method).
    """
    t0 = time.perf_counter()
    codec = get_codec(method, bits) if method is not None else None
    chain = load_chain(storage, resolve_id(storage, ckpt_id))
    tip = chain[-1]
    new_id = max(existing_dir_ids(storage) + committed_ids(storage)) + 1
    written: list[str] = []
    try:
        if codec is None:
            reports = _merge_ranks(storage, chain, new_id, written, progress)
        else:
            tables = assemble_tables(storage, chain, progress)
            reports = []
            for report in tip.ranks:
                reports.append(_write_compacted_rank(storage, report, new_id, tables, codec, progress))
                written += _files(reports[-1])
        parts = []
        for written_report in reports:
            written.append(part_path(new_id, written_report["rank"]))
            parts.append(write_part(storage, new_id, written_report))
        codec_desc = None if codec is None or method is None else codec_description(method, bits, codec.params,
                                                                                    with_setting=False)
        body = _compacted_body(chain, new_id, parts, codec_desc, (time.perf_counter() - t0) * 1e3)
        manifest = with_parts(check_manifest(body, manifest_path(new_id)), storage)
        storage.write_atomic(manifest_path(new_id), seal(body, key=storage.key))
    except BaseException:
        storage.remove_dir(ckpt_dir(new_id), written)
        raise
    write_index(storage, committed_ids(storage))
    log.info("compacted chain %s into checkpoint %d (%d bytes)", manifest.compacted_from, new_id, manifest.nbytes)
    return manifest


def _files(report: dict[str, Any]) -> list[str]:
    """The objects a rank report just written occupies (for the clean-up of a compaction that fails)."""
    return check_payload(report, f"rank {report['rank']}").files


def _merge_ranks(storage: Storage, chain: list[Manifest], new_id: int, written: list[str],
                 progress: Progress | None) -> list[dict[str, Any]]:
    """The lossless path: every rank file of the tip's layout merged (a residual chain: folded) in turn
    (``written`` collects the files, for the caller's clean-up). Each rank copies its own per-rank state, and
    rank 0 the dense state."""
    tip = chain[-1]
    regions = regions_of_layout(tip)
    reports = []
    for report in tip.ranks:
        out = CompactedFile(new_id, report.rank, rank_state=report,
                            dense_state=tip.ranks[0] if report.rank == 0 else None)
        if is_residual(chain):
            reports.append(fold_rank(storage, chain, regions[report.rank], out, codec=LOSSLESS_CODEC))
        else:
            reports.append(merge_rank(storage, chain, regions[report.rank], out))
        written += _files(reports[-1])
        if progress is not None:
            progress(len(report.entries()))
    return reports


def _compacted_body(chain: list[Manifest], new_id: int, parts: list[dict[str, Any]],
                    codec: dict[str, Any] | None, write_ms: float) -> dict[str, Any]:
    """The new baseline's manifest body: the one a background compaction writes
    (:func:`~cnr_torchrec.ckpt.compact.background.compacted_body`, which owns the chain keys), plus what
    ``cnr compact`` does differently. ``codec``: the re-encoding codec's description (None: lossless,
    which keeps the tip's codec and stores replicated tables as entries)."""
    return compacted_body(chain, parts, new_id, chain[-1].world_size, write_ms,
                          folded=LOSSLESS_CODEC if is_residual(chain) else None, recoded=codec, by=" by cnr compact")


def _write_compacted_rank(
    storage: Storage,
    report: RankReport,
    new_id: int,
    tables: Mapping[str, TableData],
    codec: Any,
    progress: Progress | None,
) -> dict[str, Any]:
    load = PayloadReader(storage, report.payload)
    blobs = PayloadWriter(storage, rank_file(new_id, report.rank), report.payload.chunk_bytes or DEFAULT_CHUNK_BYTES)
    out_tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = 0
    i = 0
    for table, entries in report.tables.items():
        data = tables[table]
        for entry in entries:
            rows, cols = entry.rows, entry.cols
            prefix = f"s{i}"
            i += 1
            encoded = codec.encode(data.weights[rows[0] : rows[1], cols[0] : cols[1]].contiguous())
            states = []
            for j, s in enumerate(entry.states):
                if j >= len(data.states):
                    raise CorruptCheckpointError(
                        f"{report.file}: table '{table}' has {len(entry.states)} optimizer states in the tip "
                        f"but the chain stored {len(data.states)}",
                        path=report.file,
                    )
                state = data.states[j]
                states.append((state.for_shard(rows, cols).to(DTYPES[report.blobs[s.blob].dtype]), state.rowwise))
            stored = write_rows(blobs, prefix, encoded, states, data.mc_rows(rows))
            rows_written += encoded.num_rows
            out_tables.setdefault(table, []).append(table_entry(rows, cols, "full", stored))
            if progress is not None:
                progress(1)
    replicated = {t: copy_blob(name, load, blobs) for t, name in report.replicated_tables.items()}
    dense = {n: copy_blob(name, load, blobs) for n, name in report.dense.items()}
    dense_opt = report.dense_optimizer
    if dense_opt is not None:
        copy_blob_tree(dense_opt, load, blobs)
    extra = {n: copy_blob_tree(tree, load, blobs) for n, tree in report.extra.items()}
    rng = copy_blob_tree(report.rng, load, blobs)
    mc_runtime = {t: copy_blob_tree(tree, load, blobs) for t, tree in report.mc_runtime.items()}
    return rank_report(
        report.rank, blobs.finish(), tables=out_tables, table_shapes=report.table_shapes, tbe_iter=report.tbe_iter,
        counts=WriteCounts(rows_written), state=StateBlobs(replicated, dense, dense_opt, extra, rng, mc_runtime),
    )
