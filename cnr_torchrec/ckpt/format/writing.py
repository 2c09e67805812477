"""The write side of the format: every table entry, rank report and manifest body is built here.

:mod:`~cnr_torchrec.ckpt.format.schema` is the one parser of what these functions build, into the frozen
types of :mod:`~cnr_torchrec.ckpt.format.manifest`; this module is its counterpart, and owns every key
name and every conditional key a writer puts in a manifest. The save (``save/writer.py``,
``save/commit.py``, ``save/baseline.py``), the compactions (``compact/merge.py``, ``compact/fold.py``,
``compact/background.py``, ``compact/offline.py``) and the DCP import all write through it, so a new field
means three places: the types, the schema and this writer.

A payload's own keys (its file, chunks and blob index) come from
:meth:`~cnr_torchrec.ckpt.format.bytes.chunks.PayloadWriter.finish`, and a flattened state tree's from
:mod:`~cnr_torchrec.ckpt.format.bytes.payload`: they are passed through as they are.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChainLinks",
    "JobFields",
    "StateBlobs",
    "WriteCounts",
    "codec_description",
    "failed_report",
    "manifest_body",
    "rank_report",
    "row_keys",
    "table_entry",
]

JSON = dict[str, Any]


def codec_description(method: str, bits: int | None, params: Mapping[str, Any],
                      bits_setting: Any = None, *, with_setting: bool = True) -> JSON:
    """A manifest's ``codec``: the method, its width and parameters (and, for a save, the ``bits`` setting that
    chose the width: ``auto`` or a number; compactions leave it out with ``with_setting=False``)."""
    out: JSON = {"method": method, "bits": bits}
    if with_setting:
        out["bits_setting"] = bits_setting
    out["params"] = dict(params)
    return out


@dataclass(frozen=True)
class ChainLinks:
    """Where a checkpoint sits in its chain, and why it was written (the manifest's chain keys).

    Attributes:
        id, step, kind: the checkpoint, the training step it records, ``baseline`` or ``delta``.
        since: what a delta's rows are dirty since (``baseline`` or ``previous``); None for a baseline.
        parent: the checkpoint a delta applies on; None for a baseline.
        base: the chain's baseline (a baseline's own id).
        depth: deltas between the base and this checkpoint (0 for a baseline).
        encodings: per table, ``full`` (every row) or ``rows`` (some rows, with their ids).
        reason: why this kind was chosen, for the log and ``cnr inspect``.
    """

    id: int
    step: int
    kind: str
    since: str | None
    parent: int | None
    base: int
    depth: int
    encodings: Mapping[str, str]
    reason: str

    @classmethod
    def baseline(cls, ckpt_id: int, step: int, encodings: Mapping[str, str], reason: str) -> ChainLinks:
        """The links of a baseline: a chain of its own."""
        return cls(ckpt_id, step, "baseline", None, None, ckpt_id, 0, encodings, reason)

    def to_json(self) -> JSON:
        return {"id": self.id, "step": self.step, "kind": self.kind, "since": self.since, "parent": self.parent,
                "base": self.base, "depth": self.depth, "encodings": dict(self.encodings), "reason": self.reason}


@dataclass(frozen=True)
class JobFields:
    """What a manifest says of the job rather than of the save.

    Attributes:
        policy: the save policy (None for a checkpoint no policy wrote: an import).
        world_size: the ranks that wrote it.
        codec: :func:`codec_description` of the rows' codec.
        restores: how many restores the job had made when it wrote this checkpoint.
        table_fqns: each table's weight name in the unsharded model.
    """

    policy: str | None
    world_size: int
    codec: Mapping[str, Any]
    restores: int
    table_fqns: Mapping[str, str] = field(default_factory=dict)


def row_keys(meta: Mapping[str, Any], weight_blobs: Mapping[str, str], states: Sequence[tuple[bool, str]],
             checks: tuple[str, int], mc: tuple[str, Sequence[str]] | None = None) -> JSON:
    """An entry's row blobs: the encoded weights (``meta``: the codec's description of them, ``weight_blobs``:
    blob by tensor name), each optimizer state ``(row-wise, blob)``, the CRC-32C blob and the rows it groups
    (``checks``), and a managed-collision table's by-row state ``(blob, fields)``."""
    out: JSON = {"weights": {"meta": dict(meta), "blobs": dict(weight_blobs)},
                 "states": [{"rowwise": rowwise, "blob": blob} for rowwise, blob in states]}
    if mc is not None:
        out["mc"] = {"blob": mc[0], "fields": list(mc[1])}
    out["checks"] = {"blob": checks[0], "rows": checks[1]}
    return out


def table_entry(rows: Sequence[int], cols: Sequence[int], encoding: str, rows_stored: Mapping[str, Any], *,
                ids: tuple[str, int, str] | None = None, residual: bool = False,
                whole: tuple[int, str] | None = None) -> JSON:
    """One stored entry of a table.

    Args:
        rows, cols: the global row and column ranges of the shard that wrote it.
        encoding: ``full`` (every row of ``rows``) or ``rows`` (the rows ``ids`` names).
        rows_stored: its row blobs (:func:`row_keys`).
        ids: ``(kind, count, blob)`` of the stored row ids (offsets into ``rows``), for ``rows``.
        residual: the rows are residuals on what the chain restores below (``quantization.residual``).
        whole: ``(count, blob)``: the bitmap of a residual entry's rows stored whole, where some are.
    """
    if whole is not None and not residual:
        raise ValueError("only a residual entry stores rows whole by a bitmap")
    out: JSON = {"rows": list(rows), "cols": list(cols), "encoding": encoding}
    if ids is not None:
        out["ids"] = {"kind": ids[0], "count": ids[1], "blob": ids[2]}
    if residual:
        out["residual"] = True
    if whole is not None:
        out["whole"] = {"count": whole[0], "blob": whole[1]}
    out.update(rows_stored)
    return out


@dataclass(frozen=True)
class StateBlobs:
    """What a rank report holds beside its tables: the blobs of the state a rank stores whole, as names and
    flattened state trees (:mod:`~cnr_torchrec.ckpt.format.bytes.payload`).

    Attributes:
        replicated_tables: each data_parallel table's blob, by table (rank 0's).
        dense: each dense parameter's blob, by name (rank 0's).
        dense_optimizer: the dense optimizer's saved form, flattened (rank 0's); None: none saved.
        extra: each ``extra_state`` object's state, flattened, by name.
        rng: the RNG states, flattened; None: not saved.
        mc_runtime: each managed-collision table's eviction window, flattened (left out of the report when empty).
    """

    replicated_tables: Mapping[str, str] = field(default_factory=dict)
    dense: Mapping[str, str] = field(default_factory=dict)
    dense_optimizer: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    rng: Any = None
    mc_runtime: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WriteCounts:
    """What a rank wrote of a checkpoint, and how long it took.

    Attributes:
        rows_written: the rows its entries store.
        residual_entries, whole_rows: count again what the entries' flags and bitmaps say (the schema
            cross-checks them, so that a manifest that drops one is refused); left out of the report when zero.
        stall_ms, write_ms: the save's stall of training, and the write's time on this rank.
    """

    rows_written: int
    residual_entries: int = 0
    whole_rows: int = 0
    stall_ms: float = 0.0
    write_ms: float = 0.0


def rank_report(rank: int, payload: Mapping[str, Any], *, tables: Mapping[str, list[JSON]],
                table_shapes: Mapping[str, Sequence[int]], tbe_iter: int, counts: WriteCounts,
                state: StateBlobs = StateBlobs()) -> JSON:
    """A rank's report of a checkpoint it wrote: its payload (``PayloadWriter.finish()``), entries by table, the
    TBE step, the blobs of what it holds beside the tables (``state``), and what it wrote (``counts``)."""
    return {
        "rank": rank,
        "ok": True,
        **payload,
        "tables": {t: list(entries) for t, entries in tables.items()},
        "replicated_tables": dict(state.replicated_tables),
        "dense": dict(state.dense),
        "dense_optimizer": state.dense_optimizer,
        "extra": dict(state.extra),
        "rng": state.rng,
        **({"mc_runtime": dict(state.mc_runtime)} if state.mc_runtime else {}),
        "tbe_iter": tbe_iter,
        "table_shapes": {t: list(s) for t, s in table_shapes.items()},
        "rows_written": counts.rows_written,
        **({"residual_entries": counts.residual_entries} if counts.residual_entries else {}),
        **({"whole_rows": counts.whole_rows} if counts.whole_rows else {}),
        "stall_ms": round(counts.stall_ms, 3),
        "write_ms": round(counts.write_ms, 3),
    }


def failed_report(rank: int, error: str) -> JSON:
    """What a rank reports when its part of a save failed: the commit fails on every rank with ``error``."""
    return {"rank": rank, "ok": False, "error": error}


def manifest_body(links: ChainLinks, job: JobFields, *, tables: Mapping[str, Sequence[int]],
                  parts: Sequence[JSON], replicated: Sequence[str] | None = None,
                  per_rank_state: bool | None = None, equals: int | None = None,
                  compacted_from: tuple[int, int] | None = None) -> JSON:
    """The body of a manifest, an index of the ranks' parts (:func:`~cnr_torchrec.ckpt.format.commits.seal`
    seals it).

    Args:
        links: the chain keys; job: the job keys.
        tables: ``[rows, dim]`` of every table of the model.
        parts: what :func:`~cnr_torchrec.ckpt.format.parts.write_part` returned for each rank, ordered by rank.
        replicated: the tables every rank holds alike (data_parallel); None: those the parts store.
        per_rank_state: whether the per-rank state (extra_state, RNG) of the writing ranks is there; left out
            (meaning yes) when None.
        equals, compacted_from: a compacted baseline's: the tip it restores as, and the chain it compacts.
    """
    if replicated is None:
        replicated = sorted({t for p in parts for t in p["replicated"]})
    body: JSON = {
        **links.to_json(),
        "policy": job.policy,
        "world_size": job.world_size,
        "codec": dict(job.codec),
        "restores": job.restores,
        "tables": {t: list(shape) for t, shape in tables.items()},
        "table_fqns": dict(job.table_fqns),
        "replicated": list(replicated),
        "nbytes": sum(int(p["line"]["payload"]) for p in parts),
        "created_unix": time.time(),
    }
    if equals is not None:
        body["equals"] = equals
    if compacted_from is not None:
        body["compacted_from"] = list(compacted_from)
    if per_rank_state is not None:
        body["per_rank_state"] = per_rank_state
    body["parts"] = [p["line"] for p in parts]
    if parts and all("boxes" in p for p in parts):
        body["shards"] = shards_of(tables, [p["boxes"] for p in parts])
    return body


def shards_of(tables: Mapping[str, Sequence[int]], boxes: Sequence[Sequence[Sequence[Any]]]) -> JSON:
    """An index's ``shards``: where each sharded table's rows live, by rank (``boxes[r]``: rank r's
    ``[table, row_start, row_end, col_start, col_end]``). A table split by rows into even blocks, one per rank
    in rank order, each the table's full width, is ``{"rows": block}``; any other a list of
    ``[rank, row_start, row_end, col_start, col_end]``."""
    by_table: dict[str, list[list[int]]] = {}
    for rank, rank_boxes in enumerate(boxes):
        for t, r0, r1, c0, c1 in rank_boxes:
            by_table.setdefault(t, []).append([rank, r0, r1, c0, c1])
    out: JSON = {}
    for t, held in sorted(by_table.items()):
        n, dim = tables[t][0], tables[t][1]
        block = held[0][2] - held[0][1]
        even = block > 0 and sorted(held) == [[r, r * block, min((r + 1) * block, n), 0, dim]
                                              for r in range(-(-n // block))]
        out[t] = {"rows": block} if even else sorted(held)
    return out
