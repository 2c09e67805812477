"""The manifest schema, defined once: what every field of a manifest body may hold.

A manifest's seal is a checksum, not a MAC: a crafted manifest re-sealed with a valid xxh3
reaches the parser. So before anything reads a blob or sizes a buffer, every manifest of a
manifest is checked against this schema as it is loaded (:func:`check_manifest`, called by
:func:`~cnr_torchrec.ckpt.format.commits.load_manifest`, and by a save before it seals one):
types and ranges, chain links, entries
inside their table's shape, row ids and encoded rows that fit their entry, and blob shapes that
match their bytes and dtype and lie inside their file. A buffer is then never sized beyond what
the manifest's tables need, and restore compares those tables with the model's own before it
changes anything. Every violation is a :class:`CorruptCheckpointError` naming the manifest and
the field, e.g. ``ranks[1].tables['t0'][2].rows``; a dtype that is never written is an
:class:`UnsafeCheckpointError` (refused, never skipped).

The check is also the parser: it builds the typed :class:`~cnr_torchrec.ckpt.format.manifest.Manifest`
as it goes, so nothing downstream reads a string key or checks a field again.

What it does not check: the bytes themselves (the checksums do, as they are read), and whether
a manifest that is consistent in itself is the one the job wrote (a checksum cannot tell; see
the README's Format section).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from cnr_torchrec.ckpt.format.bytes.integrity import CHUNK_DIGESTS
from cnr_torchrec.ckpt.format.bytes.payload import DTYPES
from cnr_torchrec.ckpt.format.manifest import (
    Blob,
    Chunk,
    Manifest,
    McRows,
    Payload,
    RankReport,
    RankSummary,
    RowChecks,
    RowIds,
    RowModes,
    StateRef,
    TableEntry,
    Weights,
    chunk_path,
    frozen,
    rank_file_of,
)
from cnr_torchrec.ckpt.format.placement import rank_boxes, records_layout
from cnr_torchrec.ckpt.format.structure import check_part_layout, check_parts
from cnr_torchrec.errors import CorruptCheckpointError, UnsafeCheckpointError
from cnr_torchrec.quant import EncodedRows, UnknownCodecError, get_codec
from cnr_torchrec.quant.registry import METHODS

__all__ = ["MAX_DEPTH", "check_manifest", "check_payload", "parse_json"]

MAX_DEPTH = 64
"""How deeply a manifest's free-form values (codec parameters, saved state trees) may nest. Written ones nest a
few levels; the limit keeps every reader's walk of a crafted one far from Python's recursion limit."""


def parse_json(data: bytes, path: str) -> Any:
    """The JSON document ``data`` (a manifest, a part, an index), read from ``path``.

    Raises:
        CorruptCheckpointError: not UTF-8 JSON, or beyond the parser's limits (nesting past the recursion
            limit, an integer of more digits than Python converts); names ``path``.
    """
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, huge integers
        why = "nests too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise CorruptCheckpointError(f"{path} is not valid JSON within the format's limits ({why}); the checkpoint "
                                     "is corrupt", path=path) from None

Check = Callable[[Any], str]
"""A field's check: the empty string when the value is fine, else what is wrong with it."""


def _int(lo: int = 0, hi: int = 1 << 62) -> Check:
    return lambda v: "" if type(v) is int and lo <= v <= hi else f"must be an integer in [{lo}, {hi}], not {v!r}"


def _opt(check: Check) -> Check:
    return lambda v: "" if v is None else check(v)


def _of(*choices: Any) -> Check:
    return lambda v: "" if v in choices else f"must be one of {list(choices)}, not {v!r}"


def _type(*types: type) -> Check:
    names = " or ".join(t.__name__ for t in types)
    return lambda v: "" if isinstance(v, types) and not isinstance(v, bool) or bool in types and type(v) is bool \
        else f"must be a {names}, not {type(v).__name__}"


def _nested(v: Any) -> str:
    """Plain JSON nested at most ``MAX_DEPTH`` levels (walked without recursion)."""
    if isinstance(v, dict) and not any(isinstance(x, (dict, list)) for x in v.values()):
        return ""  # the common case: codec parameters, module names
    stack = [(v, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list)):
            if depth >= MAX_DEPTH:
                return f"nests deeper than {MAX_DEPTH} levels"
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return ""


def _free_form(v: Any) -> str:
    """An object whose keys the format leaves open (codec parameters, the tables' module names)."""
    return _type(dict)(v) or _nested(v)


def _number(v: Any) -> str:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return "" if ok else f"must be a finite number >= 0, not {v!r}"


_BODY: dict[str, Check] = {
    "id": _int(), "step": _int(), "kind": _of("baseline", "delta"), "since": _opt(_of("baseline", "previous")),
    "parent": _opt(_int()), "base": _int(), "depth": _int(), "encodings": _type(dict), "reason": _type(str),
    "policy": _opt(_type(str)), "world_size": _int(1, 1 << 20), "codec": _free_form, "restores": _int(),
    "tables": _type(dict), "table_fqns": _free_form, "replicated": _type(list), "nbytes": _int(),
    "created_unix": _number,
}
_BODY_OPTIONAL: dict[str, Check] = {"equals": _int(), "compacted_from": _type(list), "per_rank_state": _type(bool),
                                    "shards": _type(dict),
                                    "chain": _type(list)}
_RANK: dict[str, Check] = {
    "rank": _int(), "ok": _of(True), "file": _type(str), "nbytes": _int(), "blobs": _type(dict),
    "tables": _type(dict), "replicated_tables": _type(dict), "dense": _type(dict), "tbe_iter": _int(),
    "table_shapes": _type(dict), "rows_written": _int(), "stall_ms": _number, "write_ms": _number,
    "dense_optimizer": _opt(_type(dict)), "extra": _type(dict),
}
_CHUNK: dict[str, Check] = {"nbytes": _int()}
# A rank's line in a format 7 index: its part file's size (and digest, as a chunk's), its payload's bytes and
# chunks, and what listings and the chain's step counter need.
_PART: dict[str, Check] = {"nbytes": _int(), "payload": _int(), "chunks": _int(1, 1 << 30), "rows_written": _int(),
                           "stall_ms": _number, "write_ms": _number, "tbe_iter": _int()}
_BLOB: dict[str, Check] = {"offset": _int(), "nbytes": _int(), "dtype": _of(*DTYPES), "shape": _type(list),
                           "xxh3": _type(str)}


_META: dict[str, Check] = {
    "format": _of(EncodedRows.FORMAT), "version": _of(EncodedRows.VERSION), "method": _of(*METHODS),
    "bits": _int(1, 32), "dim": _int(1), "num_rows": _int(), "params": _free_form,
}


class _Fields:
    """Raises the named error for one manifest."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, field: str, problem: str) -> None:
        raise CorruptCheckpointError(f"{self.path}: {field.lstrip('.')} {problem}. The manifest was edited or "
                                     "crafted; refusing it (restore another checkpoint with restore(step=...))",
                                     path=self.path)

    def record(self, obj: Any, field: str, spec: Mapping[str, Check], optional: Mapping[str, Check] = {}) -> None:
        if not isinstance(obj, dict):
            self.fail(field, f"must be an object, not {type(obj).__name__}")
        for key, check in spec.items():
            if key not in obj:
                self.fail(f"{field}.{key}" if field else key, "is missing")
            self.value(obj[key], f"{field}.{key}" if field else key, check)
        for key, check in optional.items():
            if key in obj:
                self.value(obj[key], f"{field}.{key}" if field else key, check)

    def value(self, v: Any, field: str, check: Check) -> None:
        problem = check(v)
        if problem:
            self.fail(field, problem)

    def pair(self, v: Any, field: str, lo: int, hi: int, *, empty: bool) -> tuple[int, int]:
        """``[a, b]`` with ``lo <= a <= b <= hi`` (``a < b`` unless ``empty``)."""
        ok = isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)
        if not ok or not lo <= v[0] <= v[1] <= hi or (not empty and v[0] == v[1]):
            self.fail(field, f"must be a range [a, b) inside [{lo}, {hi}]{'' if empty else ', not empty'}, not {v!r}")
        return v[0], v[1]


def check_manifest(body: Any, path: str) -> Manifest:
    """Checks a manifest body against the schema, and builds its :class:`Manifest`.

    Raises:
        CorruptCheckpointError: a field is missing, of another type, out of range, or does not fit the
            rest of the manifest; the message names ``path`` and the field.
        UnsafeCheckpointError: a blob has a dtype that is never written.
    """
    f = _Fields(path)
    index = isinstance(body, dict) and "parts" in body and "ranks" not in body  # format 7
    f.record(body, "", {**_BODY, ("parts" if index else "ranks"): _type(list)}, _BODY_OPTIONAL)
    _check_links(f, body)
    shapes = _table_shapes(f, body)
    for table, encoding in body["encodings"].items():
        f.value(encoding, f"encodings[{table!r}]", _of("full", "rows"))
    if index:
        return _manifest(body, (), _check_index(f, body), 7)
    ranks = body["ranks"]
    stored_whole = sorted(t for r in ranks if isinstance(r, dict) and isinstance(r.get("replicated_tables"), dict)
                          for t in r["replicated_tables"])
    if stored_whole != sorted(body["replicated"]):
        f.fail("replicated", f"lists {sorted(body['replicated'])}, but the ranks store {stored_whole} whole")
    if len(ranks) != body["world_size"]:
        f.fail("ranks", f"holds {len(ranks)} reports for a world size of {body['world_size']}")
    reports = tuple(_check_rank(f, report, f"ranks[{i}]", i, shapes) for i, report in enumerate(ranks))
    if sum(r.nbytes for r in reports) != body["nbytes"]:
        f.fail("nbytes", f"is {body['nbytes']}, but the rank files hold {sum(r.nbytes for r in reports)} bytes")
    summaries = tuple(RankSummary(r.rank, r.nbytes, len(r.payload.chunks), r.rows_written, r.stall_ms, r.write_ms,
                                  r.tbe_iter) for r in reports)
    manifest = _manifest(body, reports, summaries, 6)
    check_parts(manifest, reports)  # a format 6 manifest holds every report: they are checked together as it loads
    return manifest


def _manifest(body: Mapping[str, Any], reports: tuple[RankReport, ...], summaries: tuple[RankSummary, ...],
              version: int) -> Manifest:
    """The typed manifest of a checked body (a format 7 index gets its parts from
    :func:`~cnr_torchrec.ckpt.format.parts.with_parts`)."""
    compacted = body.get("compacted_from")
    return Manifest(
        id=body["id"], step=body["step"], kind=body["kind"], parent=body["parent"], base=body["base"],
        depth=body["depth"], since=body["since"], reason=body["reason"], policy=body["policy"],
        world_size=body["world_size"], codec=frozen(body["codec"]), restores=body["restores"],
        tables=frozen(_shapes_of(body)), table_fqns=frozen(body["table_fqns"]), replicated=tuple(body["replicated"]),
        encodings=frozen(body["encodings"]), nbytes=body["nbytes"], created_unix=float(body["created_unix"]),
        ranks=reports, summaries=summaries, version=version, equals=body.get("equals"),
        compacted_from=tuple(compacted) if compacted else None, per_rank_state=body.get("per_rank_state", True),
        body=body,
    )


def _shapes_of(body: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    return {name: (shape[0], shape[1]) for name, shape in body["tables"].items()}


def _check_index(f: _Fields, body: Mapping[str, Any]) -> tuple[RankSummary, ...]:
    """A format 7 index's ``parts``: one line per rank, whose payloads add up to the checkpoint's bytes."""
    parts = body["parts"]
    if len(parts) != body["world_size"]:
        f.fail("parts", f"holds {len(parts)} lines for a world size of {body['world_size']}")
    out = []
    for r, line in enumerate(parts):
        where = f"parts[{r}]"
        f.record(line, where, _PART, {"layout": _type(str)})
        _chunk_digest(f, line, where)
        out.append(RankSummary(r, line["payload"], line["chunks"], line["rows_written"], float(line["stall_ms"]),
                               float(line["write_ms"]), line["tbe_iter"], line.get("layout")))
    if sum(p.nbytes for p in out) != body["nbytes"]:
        f.fail("nbytes", f"is {body['nbytes']}, but the parts' payloads hold {sum(p.nbytes for p in out)} bytes")
    return tuple(out)


def check_report(report: Any, path: str) -> RankReport:
    """A rank's report as its writer is about to write it as its part (``path``): the schema of
    :func:`check_part`, against the shapes of the tables the report holds.

    Raises:
        CorruptCheckpointError: as :func:`check_part` (a writer's bug: the part is never written).
    """
    f = _Fields(path)
    f.record(report, "", {"rank": _int(), "table_shapes": _type(dict)})
    shapes = _table_shapes(f, {"tables": report["table_shapes"], "replicated": []})
    return _check_rank(f, report, "", report["rank"], shapes)


def part_digest(line: Mapping[str, Any]) -> tuple[str, bool]:
    """A checked index line's digest of its part, and whether it is keyed."""
    keyed = CHUNK_DIGESTS[1] in line
    return line[CHUNK_DIGESTS[keyed]], keyed


def check_part(raw: Any, path: str, manifest: Manifest, slot: int) -> RankReport:
    """Checks rank ``slot``'s part of a format 7 checkpoint against the schema, the index's line for it and the
    layout the index records (:func:`~cnr_torchrec.ckpt.format.structure.check_part_layout`), and builds its
    :class:`RankReport`.

    Raises:
        CorruptCheckpointError: as :func:`check_manifest`, naming the part ``path``; or the part disagrees with
            the index (another checkpoint's or rank's part, other sizes or counts, entries off its rank's shards).
        UnsafeCheckpointError: a blob has a dtype that is never written.
    """
    f = _Fields(path)
    f.record(raw, "", {"ckpt": _int(), "rank": _int()})
    rank = raw["rank"]
    if raw["ckpt"] != manifest.id or rank != slot:
        f.fail("ckpt", f"and rank say checkpoint {raw['ckpt']}, rank {rank}: not rank {slot}'s part of checkpoint "
                       f"{manifest.id}")
    report = _check_rank(f, raw, "", rank, manifest.tables)
    line = manifest.summaries[rank]
    if report.file != rank_file_of(manifest.id, rank):  # reads aimed at other files: refused, never skipped
        raise UnsafeCheckpointError(
            f"{path}: file is {report.file!r}, not rank {rank}'s payload {rank_file_of(manifest.id, rank)!r}. The "
            "part was crafted or edited; refusing it. Restore another checkpoint with restore(step=...).")
    said = (line.nbytes, line.chunks, line.rows_written, line.tbe_iter)
    has = (report.nbytes, len(report.payload.chunks), report.rows_written, report.tbe_iter)
    if said != has:
        f.fail("nbytes", f"chunks, rows_written and tbe_iter are {has}, the index says {said}")
    extra = sorted(set(report.replicated_tables) - set(manifest.replicated))
    if extra:
        f.fail("replicated_tables", f"stores {extra} whole, which the index does not list as replicated")
    lacking = sorted(set(manifest.replicated) - set(report.replicated_tables)) if rank == 0 else []
    if lacking or (rank != 0 and report.replicated_tables):  # rank 0 stores them for all (every restore reads it)
        f.fail("replicated_tables", f"of rank {rank} are {sorted(report.replicated_tables)}; rank 0 stores every "
                                    f"table the index lists as replicated ({sorted(manifest.replicated)}), no other")
    if manifest.per_rank_state and report.rng is None:
        f.fail("rng", "is missing, but the index says every part holds its rank's state (per_rank_state)")
    check_part_layout(report, manifest, path, rank_boxes(manifest, rank) if records_layout(manifest) else None)
    return report


def check_payload(report: Any, where: str, path: str = "payload") -> Payload:
    """Checks the payload keys of a rank report (``file``, ``nbytes``, chunks, ``blobs``; what
    :meth:`~cnr_torchrec.ckpt.format.bytes.chunks.PayloadWriter.finish` returns) and builds its :class:`Payload`.

    Raises:
        CorruptCheckpointError: as :func:`check_manifest`, naming ``path`` and ``where``.
    """
    f = _Fields(path)
    f.record(report, where, {"file": _type(str), "nbytes": _int(), "blobs": _type(dict)})
    return _payload(f, report, where)


def _table_shapes(f: _Fields, body: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    shapes = {}
    for name, shape in body["tables"].items():
        ok = isinstance(shape, list) and len(shape) == 2 and all(type(x) is int for x in shape)
        if not ok or not (0 <= shape[0] <= 1 << 40 and 1 <= shape[1] <= 1 << 20):
            f.fail(f"tables[{name!r}]", f"must be [rows, columns] with rows >= 0 and columns >= 1, not {shape!r}")
        shapes[name] = (shape[0], shape[1])
    for name in body["replicated"]:
        if name not in shapes:
            f.fail("replicated", f"names table {name!r}, which tables does not list")
    return shapes


def _check_links(f: _Fields, body: Mapping[str, Any]) -> None:
    cid, parent = body["id"], body["parent"]
    if body["kind"] == "baseline":
        if parent is not None or body["base"] != cid or body["depth"] != 0:
            f.fail("parent", f"base and depth of a baseline must be null, its own id and 0, not {parent!r}, "
                             f"{body['base']} and {body['depth']}")
    elif parent is None or not body["base"] <= parent < cid or body["depth"] < 1:
        f.fail("parent", f"base and depth of a delta must satisfy base <= parent < id and depth >= 1, not parent "
                         f"{parent!r}, base {body['base']}, depth {body['depth']} (id {cid})")
    if "equals" in body and (body["kind"] != "baseline" or "compacted_from" not in body):
        f.fail("equals", "is a compacted baseline's (the tip it restores as), set on a checkpoint that is not one")
    if "equals" in body and not body["equals"] < cid:
        f.fail("equals", f"must name an older checkpoint than {cid}, not {body['equals']}")


def _check_rank(f: _Fields, report: Any, where: str, index: int,
                shapes: Mapping[str, tuple[int, int]]) -> RankReport:
    f.record(report, where, _RANK)
    if report["rank"] != index:
        f.fail(f"{where}.rank", f"is {report['rank']}, at position {index}")
    payload = _payload(f, report, where)
    blobs = payload.blobs
    tables = {}
    for table, entries in report["tables"].items():
        if table not in shapes or not isinstance(entries, list):
            f.fail(f"{where}.tables[{table!r}]", "is not a list of entries of a table the manifest lists")
        tables[table] = tuple(_check_entry(f, entry, f"{where}.tables[{table!r}][{j}]", shapes[table], blobs)
                              for j, entry in enumerate(entries))
    stored = sum(e.num_stored for es in tables.values() for e in es)
    if stored != report["rows_written"]:
        f.fail(f"{where}.rows_written", f"is {report['rows_written']}, but the entries hold {stored} rows")
    if "residual_entries" in report:  # written since residual coding became the default; absent before
        residual = sum(e.residual for es in tables.values() for e in es)
        f.value(report["residual_entries"], f"{where}.residual_entries", _int())
        if report["residual_entries"] != residual:
            f.fail(f"{where}.residual_entries", f"is {report['residual_entries']}, but {residual} entries are "
                   "marked residual")
    if "whole_rows" in report:  # format 6: the rows residual entries store whole
        whole = sum(e.whole.count for es in tables.values() for e in es if e.whole is not None)
        f.value(report["whole_rows"], f"{where}.whole_rows", _int())
        if report["whole_rows"] != whole:
            f.fail(f"{where}.whole_rows", f"is {report['whole_rows']}, but the entries' row-mode bitmaps mark "
                   f"{whole} rows")
    for table, blob in report["replicated_tables"].items():
        field = f"{where}.replicated_tables[{table!r}]"
        if table not in shapes:
            f.fail(field, "names a table the manifest does not list")
        _blob_shape(f, blobs, blob, field, shapes[table])
    for name, blob in report["dense"].items():
        _blob_shape(f, blobs, blob, f"{where}.dense[{name!r}]", None)
    for key in ("dense_optimizer", "rng"):
        _check_tree(f, report.get(key), f"{where}.{key}", blobs)
    for name, tree in report.get("extra", {}).items():
        _check_tree(f, tree, f"{where}.extra[{name!r}]", blobs)
    mc_runtime = report.get("mc_runtime", {})
    if not isinstance(mc_runtime, dict):
        f.fail(f"{where}.mc_runtime", "must be an object")
    for table, tree in mc_runtime.items():
        if table not in shapes:
            f.fail(f"{where}.mc_runtime[{table!r}]", "names a table the manifest does not list")
        _check_tree(f, tree, f"{where}.mc_runtime[{table!r}]", blobs)
    return RankReport(
        rank=index, payload=payload, tables=frozen(tables), replicated_tables=frozen(report["replicated_tables"]),
        dense=frozen(report["dense"]), tbe_iter=report["tbe_iter"], table_shapes=frozen(report["table_shapes"]),
        rows_written=report["rows_written"], stall_ms=float(report["stall_ms"]), write_ms=float(report["write_ms"]),
        dense_optimizer=report["dense_optimizer"], rng=report.get("rng"), extra=frozen(report["extra"]),
        mc_runtime=frozen(mc_runtime),
    )


def _payload(f: _Fields, report: Mapping[str, Any], where: str) -> Payload:
    """The payload of a report whose ``file``, ``nbytes`` and ``blobs`` have their types."""
    chunks = _check_chunks(f, report, where)
    blobs = {name: _check_blob(f, meta, f"{where}.blobs[{name!r}]", report["nbytes"])
             for name, meta in report["blobs"].items()}
    return Payload(file=report["file"], nbytes=report["nbytes"], chunks=chunks, blobs=frozen(blobs),
                   chunk_bytes=report.get("chunk_bytes"))


def _check_chunks(f: _Fields, report: Mapping[str, Any], where: str) -> tuple[Chunk, ...]:
    """A chunked payload's chunks tile its bytes at the stride; an unchunked one (format 3) has its xxh3."""
    file, nbytes = report["file"], report["nbytes"]
    if "chunks" not in report:
        f.value(report.get("xxh3"), f"{where}.xxh3", _type(str))
        return (Chunk(file, 0, nbytes, report["xxh3"]),)
    f.value(report.get("chunk_bytes"), f"{where}.chunk_bytes", _int(64, 1 << 40))
    stride, chunks = report["chunk_bytes"], report["chunks"]
    if stride % 64:
        f.fail(f"{where}.chunk_bytes", f"is {stride}, not a multiple of 64")
    if not isinstance(chunks, list) or len(chunks) != max(1, -(-nbytes // stride)):
        f.fail(f"{where}.chunks", f"must list {max(1, -(-nbytes // stride))} chunks for {nbytes} bytes at a stride "
                                  f"of {stride}")
    keyed = []
    for k, chunk in enumerate(chunks):
        f.record(chunk, f"{where}.chunks[{k}]", _CHUNK)
        keyed.append(_chunk_digest(f, chunk, f"{where}.chunks[{k}]"))
        want = min(stride, nbytes - k * stride)
        if chunk["nbytes"] != want:
            f.fail(f"{where}.chunks[{k}].nbytes", f"is {chunk['nbytes']}; chunk {k} of {nbytes} bytes at a stride of "
                                                   f"{stride} holds {want}")
    return tuple(Chunk(chunk_path(file, k), k * stride, c["nbytes"], c[CHUNK_DIGESTS[is_keyed]], is_keyed)
                 for k, (c, is_keyed) in enumerate(zip(chunks, keyed)))


def _chunk_digest(f: _Fields, chunk: Mapping[str, Any], field: str) -> bool:
    """A chunk lists one digest: ``xxh3``, or ``blake2b`` (keyed) on a root with a key. Returns whether keyed."""
    given = [name for name in CHUNK_DIGESTS if name in chunk]
    if len(given) != 1:
        f.fail(field, f"must give one digest, {' or '.join(CHUNK_DIGESTS)}, not {given or 'none'}")
    f.value(chunk[given[0]], f"{field}.{given[0]}", _type(str))
    return given[0] == CHUNK_DIGESTS[1]


def _check_blob(f: _Fields, meta: Any, field: str, file_nbytes: int) -> Blob:
    if isinstance(meta, dict) and meta.get("dtype") not in DTYPES:
        raise UnsafeCheckpointError(
            f"{f.path}: {field}.dtype is {meta.get('dtype')!r}, which is never written (payloads are raw tensors of "
            f"{sorted(DTYPES)}; nothing is unpickled). Refusing the checkpoint; restore another with "
            "restore(step=...)")
    f.record(meta, field, _BLOB)
    shape = meta["shape"]
    if not all(type(s) is int and s >= 0 for s in shape):
        f.fail(f"{field}.shape", f"must be a list of sizes >= 0, not {shape!r}")
    if math.prod(shape) * DTYPES[meta["dtype"]].itemsize != meta["nbytes"]:
        f.fail(f"{field}.nbytes", f"is {meta['nbytes']}, but shape {shape} of {meta['dtype']} needs "
                                  f"{math.prod(shape) * DTYPES[meta['dtype']].itemsize}")
    if meta["offset"] + meta["nbytes"] > file_nbytes:
        f.fail(f"{field}.offset", f"puts the blob past the end of its {file_nbytes}-byte file")
    return Blob(offset=meta["offset"], nbytes=meta["nbytes"], dtype=meta["dtype"], shape=tuple(shape),
                xxh3=meta["xxh3"])


def _blob_shape(f: _Fields, blobs: Mapping[str, Blob], name: Any, field: str,
                shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """The shape of blob ``name``, which must exist (and have ``shape``, when given)."""
    if not isinstance(name, str) or name not in blobs:
        f.fail(field, f"names blob {name!r}, which the report does not describe")
    got = blobs[name].shape
    if shape is not None and got != tuple(shape):
        f.fail(field, f"names a blob of shape {list(got)}, where {list(shape)} is needed")
    return got


def _check_entry(f: _Fields, entry: Any, where: str, shape: tuple[int, int], blobs: Mapping[str, Blob]) -> TableEntry:
    if not isinstance(entry, dict):
        f.fail(where, "must be an object")
    r0, r1 = f.pair(entry.get("rows"), f"{where}.rows", 0, shape[0], empty=True)
    c0, c1 = f.pair(entry.get("cols"), f"{where}.cols", 0, shape[1], empty=False)
    f.value(entry.get("encoding"), f"{where}.encoding", _of("full", "rows"))
    if "residual" in entry:
        f.value(entry["residual"], f"{where}.residual", lambda v: "" if v is True else f"must be true, not {v!r}")
    ids = None
    if "ids" in entry:
        raw = entry["ids"]
        f.record(raw, f"{where}.ids", {"kind": _of("bitmap", "list"), "count": _int(0, r1 - r0), "blob": _type(str)})
        want = ((r1 - r0 + 7) // 8,) if raw["kind"] == "bitmap" else (raw["count"],)
        _blob_shape(f, blobs, raw["blob"], f"{where}.ids.blob", want)
        ids = RowIds(kind=raw["kind"], count=raw["count"], blob=raw["blob"])
    n = ids.count if ids is not None else r1 - r0
    weights = _check_weights(f, entry.get("weights"), f"{where}.weights", n, c1 - c0, blobs)
    states = entry.get("states", [])
    if not isinstance(states, list):
        f.fail(f"{where}.states", "must be a list")
    refs = []
    for k, state in enumerate(states):
        field = f"{where}.states[{k}]"
        f.record(state, field, {"rowwise": _type(bool), "blob": _type(str)})
        _blob_shape(f, blobs, state["blob"], f"{field}.blob", (n,) if state["rowwise"] else (n, c1 - c0))
        refs.append(StateRef(rowwise=state["rowwise"], blob=state["blob"]))
    checks = None
    if "checks" in entry:  # format 5
        raw = entry["checks"]
        f.record(raw, f"{where}.checks", {"blob": _type(str), "rows": _int(1, 1 << 40)})
        _blob_shape(f, blobs, raw["blob"], f"{where}.checks.blob", (-(-n // raw["rows"]),))
        if blobs[raw["blob"]].dtype != "int32":
            f.fail(f"{where}.checks.blob", f"names a blob of {blobs[raw['blob']].dtype}, where int32 is needed")
        checks = RowChecks(blob=raw["blob"], rows=raw["rows"])
    mc = None
    if "mc" in entry:
        raw = entry["mc"]
        f.record(raw, f"{where}.mc", {"blob": _type(str), "fields": _type(list)})
        if not raw["fields"] or raw["fields"][0] != "raw_id" or not all(isinstance(x, str) for x in raw["fields"]):
            f.fail(f"{where}.mc.fields", "must be a list of names starting with 'raw_id'")
        _blob_shape(f, blobs, raw["blob"], f"{where}.mc.blob", (n, len(raw["fields"])))
        if blobs[raw["blob"]].dtype != "int64":
            f.fail(f"{where}.mc.blob", f"names a blob of {blobs[raw['blob']].dtype}, where int64 is needed")
        mc = McRows(blob=raw["blob"], fields=tuple(raw["fields"]))
    whole = None
    if "whole" in entry:  # format 6: the rows of a residual entry stored whole
        raw = entry["whole"]
        f.record(raw, f"{where}.whole", {"count": _int(1, n), "blob": _type(str)})
        if not entry.get("residual"):
            f.fail(f"{where}.whole", "marks rows stored whole in an entry that is not residual (whose rows are "
                                     "all stored whole)")
        _blob_shape(f, blobs, raw["blob"], f"{where}.whole.blob", ((n + 7) // 8,))
        if blobs[raw["blob"]].dtype != "uint8":
            f.fail(f"{where}.whole.blob", f"names a blob of {blobs[raw['blob']].dtype}, where uint8 is needed")
        whole = RowModes(count=raw["count"], blob=raw["blob"])
    return TableEntry(rows=(r0, r1), cols=(c0, c1), encoding=entry["encoding"], weights=weights, ids=ids,
                      states=tuple(refs), residual=bool(entry.get("residual")), checks=checks, mc=mc, whole=whole)


def _check_weights(f: _Fields, weights: Any, where: str, n: int, dim: int, blobs: Mapping[str, Blob]) -> Weights:
    """An entry's encoded rows: ``n`` rows of ``dim`` columns, in the blobs their codec writes."""
    f.record(weights, where, {"meta": _type(dict), "blobs": _type(dict)})
    meta = weights["meta"]
    f.record(meta, f"{where}.meta", _META)
    f.value(meta["num_rows"], f"{where}.meta.num_rows", _of(n))
    f.value(meta["dim"], f"{where}.meta.dim", _of(dim))
    _check_layout(f, meta, weights["blobs"], blobs, where)
    for key, blob in weights["blobs"].items():
        got = _blob_shape(f, blobs, blob, f"{where}.blobs[{key!r}]", None)
        if not got or got[0] != n:
            f.fail(f"{where}.blobs[{key!r}]", f"names a blob of shape {list(got)}, not one row per stored row ({n})")
    return Weights(meta=frozen(meta), blobs=frozen(weights["blobs"]))


def _check_layout(f: _Fields, meta: Mapping[str, Any], names: Mapping[str, Any], blobs: Mapping[str, Blob],
                  where: str) -> None:
    """The encoded rows' blobs are exactly those their codec writes, of its dtypes and shapes."""
    try:
        codec = get_codec(meta["method"], meta["bits"], **meta["params"])
    except UnknownCodecError as e:
        f.fail(f"{where}.meta", f"names no valid codec ({e})")
    layout = codec.layout(meta["num_rows"], meta["dim"], meta["params"])
    if set(names) != set(layout):
        f.fail(f"{where}.blobs", f"are {sorted(names)}; codec {meta['method']} writes {sorted(layout)}")
    for key, (dtype, shape) in layout.items():
        want = [str(dtype).removeprefix("torch."), list(shape)]
        _blob_shape(f, blobs, names[key], f"{where}.blobs[{key!r}]", None)
        got = [blobs[names[key]].dtype, list(blobs[names[key]].shape)]
        if got != want:
            f.fail(f"{where}.blobs[{key!r}]",
                   f"names a blob of {got[0]} {got[1]}; the codec writes {want[0]} {want[1]}")


def _check_tree(f: _Fields, tree: Any, field: str, blobs: Mapping[str, Any], depth: int = 0) -> None:
    """A flattened state tree (:func:`~cnr_torchrec.ckpt.format.bytes.payload.flatten_state`): plain JSON values,
    lists, string-keyed objects, and the tagged forms ``$tensor`` (a blob of the report), ``$float``
    (inf or nan), ``$tuple`` (a list) and ``$items`` (``[key, tree]`` pairs), nested at most ``MAX_DEPTH``."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return
    if depth >= MAX_DEPTH:
        f.fail(field, f"nests deeper than {MAX_DEPTH} levels")
    depth += 1
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            _check_tree(f, v, f"{field}[{i}]", blobs, depth)
        return
    if not isinstance(tree, dict):
        f.fail(field, f"holds a {type(tree).__name__}")
    tags = [k for k in tree if k.startswith("$")]
    if not tags:
        for k, v in tree.items():
            _check_tree(f, v, f"{field}[{k!r}]", blobs, depth)
        return
    if len(tree) != 1 or tags[0] not in _TAGS:
        f.fail(field, f"must be one of {sorted(_TAGS)} alone, not keys {sorted(tree)}")
    tag, v = tags[0], tree[tags[0]]
    if tag == "$tensor":
        _blob_shape(f, blobs, v, field, None)
    elif tag == "$float":
        f.value(v, f"{field}.$float", _of("inf", "-inf", "nan"))
    elif tag == "$tuple":
        f.value(v, f"{field}.$tuple", _type(list))
        _check_tree(f, v, f"{field}.$tuple", blobs, depth)
    else:
        if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
            f.fail(f"{field}.$items", "must be a list of [key, value] pairs")
        for i, (k, item) in enumerate(v):
            f.value(k, f"{field}.$items[{i}][0]", lambda x: "" if x is None or isinstance(x, (bool, int, float, str))
                    else f"must be a plain key, not {type(x).__name__}")
            _check_tree(f, item, f"{field}.$items[{i}][1]", blobs, depth)


_TAGS = ("$tensor", "$float", "$tuple", "$items")
