"""Offline writers over a checkpoint root: ``compact`` (a chain merged into one new baseline) and
``export_state_dict`` (a plain, full-precision state_dict). Neither may run while a job writes to the same root.

``compact`` is lossless by default: it keeps every row's stored bytes (:mod:`cnr_torchrec.ckpt.save.merge`,
which the background compaction uses too). Given a codec it decodes the chain with the chain
assembly of :mod:`cnr_torchrec.ckpt.tools.offline` and encodes the rows again; ``export_state_dict``
decodes the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from cnr_torchrec.ckpt.format.manifest import (
    ckpt_dir,
    committed_ids,
    existing_dir_ids,
    manifest_path,
    rank_file,
    seal,
    write_index,
)
from cnr_torchrec.ckpt.format.chunks import DEFAULT_CHUNK_BYTES, PayloadReader, PayloadWriter, payload_files
from cnr_torchrec.ckpt.format.payload import DTYPES
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.ckpt.save.compaction import compacted_body
from cnr_torchrec.ckpt.save.merge import copy_blob, copy_blob_tree, merge_rank, regions_of_layout
from cnr_torchrec.ckpt.tools.offline import Progress, TableData, assemble_tables, count_entries, load_chain
from cnr_torchrec.ckpt.tools.root import resolve_id
from cnr_torchrec.errors import CorruptCheckpointError
from cnr_torchrec.quant import get_codec

__all__ = ["compact", "export_state_dict"]

log = logging.getLogger(__name__)


def compact(
    storage: Storage,
    ckpt_id: int | None = None,
    *,
    method: str | None = None,
    bits: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Merges ``ckpt_id``'s chain (default: the newest committed) into a new baseline with the next free id.

    The new checkpoint has the tip's step and world size, and restores what the tip restores
    (``equals`` names the tip). By default (``method=None``) it is lossless: each row keeps the
    stored bytes of the newest checkpoint that holds it (:mod:`cnr_torchrec.ckpt.save.merge`), so
    restoring it equals restoring the chain bit for bit, whatever the codec. With a
    ``method``, the chain's rows are decoded and encoded again with that codec in the tip's
    shard layout (their error adds to the chain's own). Either way it copies the tip's dense
    parameters, dense optimizer, extra and RNG state and TBE step.

    Rank files are written first, then the sealed manifest atomically (the commit), then
    index.json: the Checkpointer's protocol. Must not run while a job writes to the root.

    Returns:
        The new checkpoint's manifest body.

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
            for report in sorted(tip["ranks"], key=lambda r: r["rank"]):
                reports.append(_write_compacted_rank(storage, report, new_id, tables, codec, progress))
                written += payload_files(reports[-1])
        codec_desc = None if codec is None else {"method": method, "bits": bits, "params": codec.params}
        body = _compacted_body(chain, new_id, reports, codec_desc, (time.perf_counter() - t0) * 1e3)
        storage.write_atomic(manifest_path(new_id), seal(body))
    except BaseException:
        storage.remove_dir(ckpt_dir(new_id), written)
        raise
    write_index(storage, committed_ids(storage))
    log.info("compacted chain %s into checkpoint %d (%d bytes)", body["compacted_from"], new_id, body["nbytes"])
    return body


def _merge_ranks(storage: Storage, chain: list[dict[str, Any]], new_id: int, written: list[str],
                 progress: Progress | None) -> list[dict[str, Any]]:
    """The lossless path: every rank file of the tip's layout merged in turn (``written`` collects the files,
    for the caller's clean-up). Each rank copies its own per-rank state, and rank 0 the dense state."""
    tip = chain[-1]
    regions = regions_of_layout(tip)
    by_rank = {int(r["rank"]): r for r in tip["ranks"]}
    reports = []
    for rank in sorted(by_rank):
        reports.append(merge_rank(storage, chain, regions[rank], new_id=new_id, rank=rank, rank_state=by_rank[rank],
                                  dense_state=by_rank[0] if rank == 0 else None, table_shapes=tip["tables"]))
        written += payload_files(reports[-1])
        if progress is not None:
            progress(count_entries([{"ranks": [by_rank[rank]]}]))
    return reports


def _compacted_body(chain: list[dict[str, Any]], new_id: int, reports: list[dict[str, Any]],
                    codec: dict[str, Any] | None, write_ms: float) -> dict[str, Any]:
    """The new baseline's manifest body: the one a background compaction writes
    (:func:`~cnr_torchrec.ckpt.save.compaction.compacted_body`, which owns the chain keys), plus what
    ``cnr compact`` does differently. ``codec``: the re-encoding codec's description (None: lossless,
    which keeps the tip's codec and stores replicated tables as entries)."""
    tip = chain[-1]
    body = compacted_body(chain, reports, new_id, tip["world_size"], write_ms)
    body["reason"] += " by cnr compact"
    if codec is not None:  # the re-encoded rows, written whole in the tip's layout
        body.update(codec=codec, encodings={t: "full" for t in tip["tables"]},
                    replicated=list(tip.get("replicated", [])))
    return body


def _write_compacted_rank(
    storage: Storage,
    report: Mapping[str, Any],
    new_id: int,
    tables: Mapping[str, TableData],
    codec: Any,
    progress: Progress | None,
) -> dict[str, Any]:
    load = PayloadReader(storage, report)
    blobs = PayloadWriter(storage, rank_file(new_id, int(report["rank"])), int(report.get("chunk_bytes",
                                                                                       DEFAULT_CHUNK_BYTES)))
    out_tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = 0
    i = 0
    for table, entries in report["tables"].items():
        data = tables[table]
        for entry in entries:
            rows = (int(entry["rows"][0]), int(entry["rows"][1]))
            cols = (int(entry["cols"][0]), int(entry["cols"][1]))
            prefix = f"s{i}"
            i += 1
            encoded = codec.encode(data.weights[rows[0] : rows[1], cols[0] : cols[1]].contiguous())
            out: dict[str, Any] = {"rows": list(rows), "cols": list(cols), "encoding": "full"}
            out["weights"] = {
                "meta": encoded.metadata(),
                "blobs": {k: blobs.add(f"{prefix}/w/{k}", v) for k, v in encoded.to_tensors().items()},
            }
            states = []
            for j, s in enumerate(entry.get("states", [])):
                if j >= len(data.states):
                    raise CorruptCheckpointError(
                        f"{report['file']}: table '{table}' has {len(entry['states'])} optimizer states in the tip "
                        f"but the chain stored {len(data.states)}",
                        path=report["file"],
                    )
                state = data.states[j]
                dtype = DTYPES.get(report["blobs"].get(s["blob"], {}).get("dtype", "float32"), torch.float32)
                t = state.for_shard(rows, cols).to(dtype)
                states.append({"rowwise": state.rowwise, "blob": blobs.add(f"{prefix}/state{j}", t)})
            out["states"] = states
            rows_written += encoded.num_rows
            out_tables.setdefault(table, []).append(out)
            if progress is not None:
                progress(1)
    replicated = {t: copy_blob(name, load, blobs) for t, name in report["replicated_tables"].items()}
    dense = {n: copy_blob(name, load, blobs) for n, name in report["dense"].items()}
    dense_opt = report.get("dense_optimizer")
    if dense_opt is not None:
        copy_blob_tree(dense_opt, load, blobs)
    extra = {n: copy_blob_tree(tree, load, blobs) for n, tree in report.get("extra", {}).items()}
    rng = copy_blob_tree(report.get("rng"), load, blobs)
    return {
        "rank": report["rank"],
        "ok": True,
        **blobs.finish(),
        "tables": out_tables,
        "replicated_tables": replicated,
        "dense": dense,
        "dense_optimizer": dense_opt,
        "extra": extra,
        "rng": rng,
        "tbe_iter": report.get("tbe_iter", 0),
        "table_shapes": report.get("table_shapes", {}),
        "rows_written": rows_written,
        "stall_ms": 0.0,
        "write_ms": 0.0,
    }


# ---------------------------------------------------------------------- export


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
    fqns = tip.get("table_fqns", {})
    out: dict[str, torch.Tensor] = {}
    for table in sorted(tables):
        name = fqns.get(table, f"{table}.weight")
        data = tables[table]
        out[name] = data.weights
        for i, s in enumerate(data.states):
            out[f"{name}.optimizer_state.{i}"] = s.per_row() if s.rowwise else s.values
    first = next(r for r in tip["ranks"] if r["rank"] == 0)
    load0 = PayloadReader(storage, first)
    for name, blob in first["dense"].items():
        if name in out:
            raise CorruptCheckpointError(
                f"{manifest_path(tip['id'])}: dense parameter {name!r} has the name of a table", path=first["file"]
            )
        out[name] = load0(blob).clone()
    return out
