"""Offline reading of a checkpoint root, with no model and no process group: summaries and chain merging.

A restore applies a baseline and its deltas in order; here the same entries are applied
to whole, unsharded tables held in memory (every entry carries its global row and column
range, and its rows carry offsets into that range). The result feeds ``cnr compact``
(a new baseline with the tip's shard layout) and ``cnr export`` (a plain state_dict), both
in :mod:`cnr_torchrec.ckpt.tools.compact`.

Row-wise optimizer state is one value per row of a column shard. It is kept here
expanded to one value per row and column (every column of a shard holds the shard's
value), so that it can be cut again along any column range: exactly the saved value
when the range is one saved shard, the width-weighted mean otherwise (which is what a
restore onto such a shard computes).

None of this may run while a training job writes to the same root: ``compact`` takes the
next free checkpoint id, which the job would take too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from cnr_torchrec.ckpt.format.manifest import (
    chain_ids,
    ckpt_dir,
    committed_ids,
    existing_dir_ids,
    load_manifest,
    manifest_path,
    walk_chain,
)
from cnr_torchrec.ckpt.format.chunks import PayloadReader, chunks_of
from cnr_torchrec.ckpt.format.state import decode_ids
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.ckpt.tools.verify import verify_checkpoint
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, decode

__all__ = [
    "RowState",
    "TableData",
    "load_chain",
    "assemble_tables",
    "count_entries",
    "checkpoint_row",
    "full_snapshot_nbytes",
    "summarize",
]

log = logging.getLogger(__name__)

Progress = Callable[[int], Any]
"""Called with the number of entries just processed (``tqdm.update`` fits)."""


# ---------------------------------------------------------------------- chains


def load_chain(storage: Storage, ckpt_id: int, *, verify: bool = True) -> list[dict[str, Any]]:
    """The manifests of ``ckpt_id``'s chain, baseline first.

    Args:
        verify: also check every file of every member (sizes, xxh3 of files and blobs,
            references) with :func:`cnr_torchrec.ckpt.tools.verify.verify_checkpoint`.

    Raises:
        CheckpointNotFoundError: ``ckpt_id`` is not committed.
        CorruptCheckpointError: a member is missing or fails its checks; names the file.
    """
    if not storage.exists(manifest_path(ckpt_id)):
        raise CheckpointNotFoundError(f"checkpoint {ckpt_id} is not committed under {storage.root}")
    if verify:
        problems = verify_checkpoint(storage, ckpt_id)
        if problems:
            p = problems[0]
            more = f" (and {len(problems) - 1} more problems; `cnr verify` lists them)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"{p.path}: {p.message}{more}", path=p.path)
    return walk_chain(load_manifest(storage, ckpt_id), lambda i: load_manifest(storage, i))


def count_entries(chain: list[Mapping[str, Any]]) -> int:
    """Table entries in a chain (for a progress bar)."""
    return sum(len(es) for m in chain for r in m["ranks"] for es in r["tables"].values())


@dataclass
class RowState:
    """One optimizer state of a whole table (momentum, row-wise Adagrad sum...).

    Attributes:
        rowwise: one value per row of each shard (row-wise Adagrad) rather than one per element.
        values: float32 ``[rows, dim]``; for row-wise state, every column of a shard holds
            that shard's value.
        dtype: the dtype the checkpoint stored it in (the ``state_dtype`` of the job).
    """

    rowwise: bool
    values: torch.Tensor
    dtype: torch.dtype = torch.float32

    def for_shard(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The state as a shard with these global ranges stores it: ``[rows]`` if row-wise, else ``[rows, cols]``."""
        block = self.values[rows[0] : rows[1], cols[0] : cols[1]]
        if not self.rowwise:
            return block.contiguous()
        return _row_mean(block)

    def per_row(self) -> torch.Tensor:
        """Row-wise state of the unsharded table (``[rows]``): the column-width-weighted mean over its shards."""
        if not self.rowwise:
            raise ValueError("per_row() is for row-wise state")
        return _row_mean(self.values)


def _row_mean(block: torch.Tensor) -> torch.Tensor:
    # Exact when every column holds the same value (one saved shard), the width-weighted mean otherwise.
    first = block[:, :1]
    if bool((block == first).all()):
        return first[:, 0].clone()
    return block.double().mean(dim=1).float()


class TableData(NamedTuple):
    """A whole table after applying a chain: fp32 weights ``[rows, dim]`` and its optimizer states."""

    weights: torch.Tensor
    states: list[RowState]


def _decode_entry(
    table: str, entry: Mapping[str, Any], load: PayloadReader, file: str
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[bool, torch.Tensor, torch.dtype]]]:
    """Global row ids, decoded fp32 weight rows and state rows of one entry."""
    r0, r1 = (int(v) for v in entry["rows"])
    n_rows = r1 - r0
    if "ids" in entry:
        ids = decode_ids(entry["ids"]["kind"], load(entry["ids"]["blob"]), n_rows)
        if ids.numel() != entry["ids"]["count"] or (ids.numel() and int(ids[-1]) >= n_rows):
            raise CorruptCheckpointError(f"{file}: row ids of table '{table}' do not match their entry", path=file)
    else:
        ids = torch.arange(n_rows, dtype=torch.int64)
    tensors = {k: load(name) for k, name in entry["weights"]["blobs"].items()}
    try:
        weights = decode(EncodedRows.from_tensors(tensors, entry["weights"]["meta"]))
    except EncodingFormatError as e:
        raise CorruptCheckpointError(
            f"{file}: encoded rows of table '{table}' are inconsistent: {e}", path=file
        ) from None
    if weights.shape[0] != ids.numel():
        raise CorruptCheckpointError(
            f"{file}: table '{table}' stores {weights.shape[0]} rows for {ids.numel()} ids", path=file
        )
    states = []
    for s in entry.get("states", []):
        t = load(s["blob"])
        if t.shape[0] != ids.numel():
            raise CorruptCheckpointError(
                f"{file}: optimizer state of table '{table}' has {t.shape[0]} rows for {ids.numel()} ids", path=file
            )
        states.append((bool(s["rowwise"]), t, t.dtype))
    return ids + r0, weights, states


def assemble_tables(
    storage: Storage, chain: list[Mapping[str, Any]], progress: Progress | None = None,
    tables: Collection[str] | None = None,
) -> dict[str, TableData]:
    """Applies every entry of ``chain`` (baseline first) to whole tables, by global row and column range.

    A residual entry (``quantization.residual``) adds to the rows instead of replacing them.

    Replicated (data_parallel) tables come from the tip, as in a restore; they have no
    row states (the dense optimizer holds theirs).

    Args:
        tables: only these tables (default: every one). Their blobs are then read one by one
            (range reads) instead of whole files, since only a part of each file is needed.

    Raises:
        CorruptCheckpointError: an entry does not decode, or the chain leaves part of a table unwritten.
    """
    tip = chain[-1]
    shapes = {t: (int(s[0]), int(s[1])) for t, s in tip["tables"].items() if tables is None or t in tables}
    replicated = set(tip.get("replicated", [])) & set(shapes)
    out: dict[str, TableData] = {}
    covered: dict[str, torch.Tensor] = {}
    for m in chain:
        for report in m["ranks"]:
            file = report["file"]
            load = PayloadReader(storage, report, whole=tables is None)
            for table, entries in report["tables"].items():
                if tables is not None and table not in tables:
                    continue
                if table not in shapes:
                    raise CorruptCheckpointError(
                        f"{file}: table '{table}' is not among the tables of checkpoint {tip['id']}", path=file
                    )
                rows, dim = shapes[table]
                if table not in out:
                    out[table] = TableData(torch.zeros(rows, dim, dtype=torch.float32), [])
                    covered[table] = torch.zeros(rows, dim, dtype=torch.bool)
                for entry in entries:
                    _apply_entry(out[table], covered[table], table, entry, load, file)
                    if progress is not None:
                        progress(1)
    out.update(_replicated_tables(storage, tip, replicated, shapes, whole=tables is None))
    _check_covered(chain, [t for t in shapes if t not in replicated], covered)
    return out


def _apply_entry(data: TableData, covered: torch.Tensor, table: str, entry: Mapping[str, Any], load: PayloadReader,
                 file: str) -> None:
    """Writes one entry's rows and row states into ``data`` (adds them, for a residual entry), and marks them."""
    rows, dim = data.weights.shape
    c0, c1 = (int(v) for v in entry["cols"])
    r0, r1 = (int(v) for v in entry["rows"])
    if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= dim):
        raise CorruptCheckpointError(
            f"{file}: an entry of table '{table}' spans rows [{r0}, {r1}) x cols [{c0}, {c1}), "
            f"outside the table's {rows} x {dim}",
            path=file,
        )
    global_rows, weights, states = _decode_entry(table, entry, load, file)
    if weights.shape[1] != c1 - c0:
        raise CorruptCheckpointError(
            f"{file}: table '{table}' stores rows of {weights.shape[1]} values for columns [{c0}, {c1})",
            path=file,
        )
    if entry.get("residual"):  # quantization.residual: added to what the older entries restore
        data.weights[global_rows, c0:c1] += weights.float()
    else:
        data.weights[global_rows, c0:c1] = weights.float()
    covered[global_rows, c0:c1] = True
    for j, (rowwise, t, dtype) in enumerate(states):
        if j == len(data.states):
            data.states.append(RowState(rowwise, torch.zeros(rows, dim, dtype=torch.float32), dtype))
        state = data.states[j]
        state.rowwise, state.dtype = rowwise, dtype
        vals = t.float().reshape(t.shape[0], -1)
        state.values[global_rows, c0:c1] = vals.expand(-1, c1 - c0) if rowwise else vals


def _replicated_tables(storage: Storage, tip: Mapping[str, Any], replicated: set[str],
                       shapes: Mapping[str, tuple[int, int]], *, whole: bool) -> dict[str, TableData]:
    """The data_parallel tables, whole, from rank 0's report of the tip (as a restore takes them)."""
    first = next(r for r in tip["ranks"] if r["rank"] == 0)
    load0 = PayloadReader(storage, first, whole=whole)
    out = {}
    for table in sorted(replicated):
        if table not in first["replicated_tables"]:
            raise CorruptCheckpointError(
                f"{first['file']}: replicated table '{table}' is not stored by rank 0", path=first["file"]
            )
        full = load0(first["replicated_tables"][table]).float()
        if tuple(full.shape) != shapes[table]:
            raise CorruptCheckpointError(
                f"{first['file']}: replicated table '{table}' is {list(full.shape)}, the manifest says "
                f"{list(shapes[table])}",
                path=first["file"],
            )
        out[table] = TableData(full.clone(), [])
    return out


def _check_covered(chain: list[Mapping[str, Any]], tables: list[str], covered: Mapping[str, torch.Tensor]) -> None:
    """Every row and column of the sharded ``tables`` was written by some entry of the chain."""
    for table in tables:
        if table not in covered or not bool(covered[table].all()):
            base = manifest_path(chain[0]["id"])
            missing = 0 if table not in covered else int((~covered[table]).any(dim=1).sum())
            raise CorruptCheckpointError(
                f"the chain {[m['id'] for m in chain]} leaves {missing or 'all'} rows of table '{table}' unwritten; "
                f"its baseline ({base}) is incomplete",
                path=base,
            )


# ---------------------------------------------------------------------- summaries


def _entries(m: Mapping[str, Any]):
    for r in m["ranks"]:
        for table, es in r["tables"].items():
            for e in es:
                yield r, table, e


def full_snapshot_nbytes(m: Mapping[str, Any], *, with_state: bool = True) -> int:
    """Bytes of a full fp32 snapshot of the checkpoint's tables (and their row optimizer state)."""
    shapes = m["tables"]
    if not with_state:
        return sum(int(r) * int(d) * 4 for r, d in shapes.values())
    total = sum(int(shapes[t][0]) * int(shapes[t][1]) * 4 for t in m.get("replicated", []))
    for _, _, e in _entries(m):
        n, w = e["rows"][1] - e["rows"][0], e["cols"][1] - e["cols"][0]
        total += n * w * 4 + sum(n * 4 if s["rowwise"] else n * w * 4 for s in e.get("states", []))
    return total


def checkpoint_row(m: Mapping[str, Any]) -> dict[str, Any]:
    """One checkpoint as a report row (the ``checkpoints`` items of a ``cnr-report``, plus a few keys).

    ``total_rows`` counts the rows the sharded tables' shards hold (a row split over k
    column shards counts k times, as ``rows_written`` counts it), so a baseline's
    ``dirty_fraction`` is 1.
    """
    total_rows = sum(e["rows"][1] - e["rows"][0] for _, _, e in _entries(m))
    rows_written = sum(int(r["rows_written"]) for r in m["ranks"])
    codec = m.get("codec", {})
    return {
        "id": m["id"],
        "step": m["step"],
        "kind": m["kind"],
        "method": codec.get("method"),
        "bits": codec.get("bits"),
        "rows_written": rows_written,
        "total_rows": total_rows,
        "dirty_fraction": rows_written / total_rows if total_rows else 0.0,
        "nbytes": int(m["nbytes"]),
        "stall_ms": max(float(r["stall_ms"]) for r in m["ranks"]),
        "write_ms": max(float(r["write_ms"]) for r in m["ranks"]),
        "policy": m.get("policy"),
        "parent": m.get("parent"),
        "base": m["base"],
        "depth": m["depth"],
        "world_size": m["world_size"],
        "reason": m.get("reason", ""),
        "compacted_from": m.get("compacted_from"),
        "files": {c.path: c.nbytes for r in m["ranks"] for c in chunks_of(r)},
    }


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
    """Everything ``cnr inspect`` shows about a root, in the ``cnr-report`` schema (which the example job's
    plots read too).

    Returns:
        ``{"format": "cnr-report", "version": 1, "world_size", "full_snapshot_nbytes",
        "checkpoints": [checkpoint_row(...)...], ...}`` plus ``root``,
        ``full_snapshot_table_nbytes`` (weights alone), ``total_nbytes``, ``uncommitted``
        (directories without a manifest: ``{"id", "files"}``) and ``corrupt``
        (``{"id", "path", "message"}`` for manifests that do not load).
    """
    rows, corrupt, manifests = [], [], []
    for i in committed_ids(storage):
        try:
            m = load_manifest(storage, i)
        except CorruptCheckpointError as e:
            corrupt.append({"id": i, "path": e.path or manifest_path(i), "message": str(e)})
            continue
        manifests.append(m)
        rows.append(checkpoint_row(m))
    bodies = {m["id"]: m for m in manifests}
    for r, m in zip(rows, manifests):
        r["chain"] = list(chain_ids(m, bodies))
    committed = {r["id"] for r in rows} | {c["id"] for c in corrupt}
    uncommitted = [{"id": i, "files": _dir_files(storage, i)} for i in existing_dir_ids(storage) if i not in committed]
    newest = manifests[-1] if manifests else None
    return {
        "format": "cnr-report",
        "version": 1,
        "root": storage.root,
        "world_size": newest["world_size"] if newest else None,
        "full_snapshot_nbytes": full_snapshot_nbytes(newest) if newest else 0,
        "full_snapshot_table_nbytes": full_snapshot_nbytes(newest, with_state=False) if newest else 0,
        "total_nbytes": sum(r["nbytes"] for r in rows),
        "checkpoints": rows,
        "uncommitted": uncommitted,
        "corrupt": corrupt,
    }
