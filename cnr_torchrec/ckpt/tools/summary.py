"""What ``cnr inspect`` (and the example job's plots) show about a root: one row per checkpoint, and the root's totals.

Everything here reads manifests and the sizes of payload files (an existence check, the one a restore makes
when it picks a checkpoint); no payload byte is read.
"""

from __future__ import annotations

import os
from typing import Any

from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    chain_ids,
    ckpt_dir,
    committed_ids,
    existing_dir_ids,
    load_manifest,
    manifest_path,
)
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.origin import read_origin
from cnr_torchrec.ckpt.live.dense_optim import describe
from cnr_torchrec.ckpt.restore.resolve import resolve_chain
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["checkpoint_row", "dense_optimizer_info", "full_snapshot_nbytes", "reconstruction_nbytes", "summarize"]


def full_snapshot_nbytes(m: Manifest, *, with_state: bool = True) -> int:
    """Bytes of a full fp32 snapshot of the checkpoint's tables (and their row optimizer state)."""
    if not with_state:
        return sum(r * d * 4 for r, d in m.tables.values())
    total = sum(m.tables[t][0] * m.tables[t][1] * 4 for t in m.replicated)
    for _, _, e in m.entries():
        n, w = e.num_rows, e.cols[1] - e.cols[0]
        total += n * w * 4 + sum(n * 4 if s.rowwise else n * w * 4 for s in e.states)
    return total


def dense_optimizer_info(m: Manifest) -> dict[str, str | None] | None:
    """What dense optimizer state ``m`` holds: None (none), or ``{"kind", "class"}`` (see
    :class:`~cnr_torchrec.ckpt.live.dense_optim.SavedDenseOptimizer`; ``class`` None where it was not
    recorded, and ``kind`` ``"malformed"`` for a tree of no known form, which ``cnr verify`` reports)."""
    try:
        return describe(m.ranks[0].dense_optimizer)
    except CorruptCheckpointError:
        return {"kind": "malformed", "class": None}


def checkpoint_row(m: Manifest) -> dict[str, Any]:
    """One checkpoint as a report row (the ``checkpoints`` items of a ``cnr-report``, plus a few keys).

    ``total_rows`` counts the rows the sharded tables' shards hold (a row split over k
    column shards counts k times, as ``rows_written`` counts it), so a baseline's
    ``dirty_fraction`` is 1. ``dense_optimizer`` is :func:`dense_optimizer_info`'s.
    """
    total_rows = sum(e.num_rows for _, _, e in m.entries())
    return {
        "id": m.id,
        "step": m.step,
        "kind": m.kind,
        "method": m.codec.get("method"),
        "bits": m.codec.get("bits"),
        "rows_written": m.rows_written,
        "total_rows": total_rows,
        "dirty_fraction": m.rows_written / total_rows if total_rows else 0.0,
        "nbytes": m.nbytes,
        "stall_ms": m.stall_ms,
        "write_ms": m.write_ms,
        "policy": m.policy,
        "parent": m.parent,
        "base": m.base,
        "depth": m.depth,
        "world_size": m.world_size,
        "reason": m.reason,
        "compacted_from": list(m.compacted_from) if m.compacted_from else None,
        "residual": any(e.residual for _, _, e in m.entries()),
        # Of the rows its residual entries store, those stored whole (the rest are residuals).
        "whole_rows": sum(e.whole.count for _, _, e in m.entries() if e.whole is not None),
        "dense_optimizer": dense_optimizer_info(m),
        "files": {c.path: c.nbytes for r in m.ranks for c in r.payload.chunks},
    }


def reconstruction_nbytes(m: Manifest) -> int:
    """Host memory a job resuming ``m`` with ``quantization.residual`` keeps, over all its ranks, at ``m``'s world
    size: a float32 copy of every shard (a data_parallel table once per rank)."""
    sharded = sum(r * d * 4 for t, (r, d) in m.tables.items() if t not in m.replicated)
    return sharded + m.world_size * sum(m.tables[t][0] * m.tables[t][1] * 4 for t in m.replicated)


def _dir_files(storage: Storage, ckpt_id: int) -> dict[str, int]:
    if storage.local_dir is None:
        return {}
    d = os.path.join(storage.local_dir, ckpt_dir(ckpt_id))
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return {}
    return {f"{ckpt_dir(ckpt_id)}/{n}": os.path.getsize(os.path.join(d, n)) for n in names
            if os.path.isfile(os.path.join(d, n))}


def summarize(storage: Storage) -> dict[str, Any]:
    """Everything ``cnr inspect`` shows about a root, in the ``cnr-report`` schema (which the example job's plots read).

    Returns:
        ``{"format": "cnr-report", "version": 1, "world_size", "full_snapshot_nbytes",
        "checkpoints": [checkpoint_row(...)...], ...}`` plus ``root``,
        ``full_snapshot_table_nbytes`` (weights alone), ``total_nbytes``, ``uncommitted``
        (directories without a manifest: ``{"id", "files"}``) and ``corrupt``
        (``{"id", "path", "message"}`` for manifests that do not load or break the schema), and
        ``origin``: where a warm-started root came from (:mod:`~cnr_torchrec.ckpt.format.origin`; None), and
        ``reconstruction_nbytes``: the host memory a job resuming the newest checkpoint keeps when it holds
        residual rows (0 otherwise). Each row also holds ``chain`` (its members' ids, baseline first, as far as
        their manifests load) and ``broken_member``: None, or the id of a member of its chain whose manifest
        does not load (corrupt, or not committed), which keeps the checkpoint from being restored, and
        ``missing_files``: its payload files that are gone or of another size (an existence check). The root's
        ``newest_restorable`` is the checkpoint a restore takes (the newest whose chain is sound as far as
        manifests and file sizes tell, as a restore checks it; None: none), and ``unrestorable`` the checkpoints
        the restore found unsound on the way (``{"id", "why"}``; a newer one whose chain holds one is passed
        over with it).
    """
    rows, corrupt, manifests = [], [], []
    for i in committed_ids(storage):
        try:
            m = load_manifest(storage, i)
        except (CorruptCheckpointError, UnsafeCheckpointError) as e:
            corrupt.append({"id": i, "path": getattr(e, "path", None) or manifest_path(i), "message": str(e)})
            continue
        manifests.append(m)
        rows.append(checkpoint_row(m))
    by_id = {m.id: m for m in manifests}
    for r, m in zip(rows, manifests):
        chain = chain_ids(m, by_id)  # stops below a member whose manifest did not load
        r["chain"] = list(chain)
        first = by_id[chain[0]]
        r["broken_member"] = None if len(chain) == m.depth + 1 else (
            first.parent if first.parent is not None else first.id)
    for r, m in zip(rows, manifests):
        r["missing_files"] = _missing_files(storage, m)
    pick, _ = resolve_chain(storage, None, {}, fail=False, quiet=True)  # what a restore takes, as it checks it
    committed = {r["id"] for r in rows} | {c["id"] for c in corrupt}
    uncommitted = [{"id": i, "files": _dir_files(storage, i)} for i in existing_dir_ids(storage) if i not in committed]
    newest = manifests[-1] if manifests else None
    return {
        "format": "cnr-report",
        "version": 1,
        "root": storage.root,
        "world_size": newest.world_size if newest else None,
        "full_snapshot_nbytes": full_snapshot_nbytes(newest) if newest else 0,
        "full_snapshot_table_nbytes": full_snapshot_nbytes(newest, with_state=False) if newest else 0,
        "reconstruction_nbytes": reconstruction_nbytes(newest) if newest and rows[-1]["residual"] else 0,
        "total_nbytes": sum(r["nbytes"] for r in rows),
        "checkpoints": rows,
        "uncommitted": uncommitted,
        "corrupt": corrupt,
        "origin": read_origin(storage),
        "newest_restorable": pick.chain[-1] if pick.chain else None,
        "unrestorable": [{"id": i, "why": why} for i, why in pick.skipped],
    }


def _missing_files(storage: Storage, m: Manifest) -> list[str]:
    """The files of ``m``'s payloads that are not there or not of the size the manifest gives (an existence
    check: no byte is read)."""
    missing = []
    for report in m.ranks:
        for chunk in report.payload.chunks:
            try:
                size = storage.size(chunk.path)
            except CheckpointNotFoundError:
                missing.append(chunk.path)
                continue
            if size is not None and size != chunk.nbytes:
                missing.append(f"{chunk.path} ({size} bytes, not {chunk.nbytes})")
    return missing
