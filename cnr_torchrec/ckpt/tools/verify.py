"""Offline integrity check of a checkpoint root: every byte the manifests vouch for, and every reference.

For each committed checkpoint: the manifest loads and matches its seal and is byte for
byte the sealed form of its body (so even a flipped whitespace byte is caught); every rank
file exists and has the size and whole-file xxh3 the manifest gives; every blob lies
inside its file, has a known dtype whose size matches its shape, and matches its own
xxh3; every entry references blobs that exist, its ranges lie inside its table, its
row ids decode to the count it claims and its encoded rows are consistent; nested state
refers only to existing blobs; and a delta's chain members exist and verify. index.json,
when present, must be a valid index listing only committed checkpoints.

Nothing is unpickled: manifests are JSON and payloads are raw bytes.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cnr_torchrec.ckpt.format.chunks import chunks_of
from cnr_torchrec.ckpt.format.manifest import INDEX, ckpt_dir, committed_ids, load_manifest, manifest_path, seal
from cnr_torchrec.ckpt.format.payload import DTYPES, checksum, unflatten_state
from cnr_torchrec.ckpt.format.schema import check_manifest
from cnr_torchrec.ckpt.format.state import decode_ids
from cnr_torchrec.ckpt.format.storage import Storage, check_bytes, check_relative
from cnr_torchrec.ckpt.tools.root import open_storage, resolve_id
from cnr_torchrec.errors import CheckpointNotFoundError, CnrError, CorruptCheckpointError
from cnr_torchrec.quant import EncodedRows

__all__ = ["Problem", "verify_checkpoint", "verify_root"]

log = logging.getLogger(__name__)

_MAX_BLOB_PROBLEMS = 10  # per file: a damaged file would otherwise list every blob


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint root.

    Attributes:
        ckpt_id: the checkpoint it belongs to (None for index.json and the root itself).
        path: the file, relative to the root.
        message: what is wrong, in words.
    """

    ckpt_id: int | None
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class _Verifier:
    """Checks checkpoints of one root; each checkpoint's own files are checked once."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._own: dict[int, list[Problem]] = {}
        self._bodies: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, ckpt_id: int) -> list[Problem]:
        """This checkpoint's own problems, then those of its chain."""
        problems = list(self.own(ckpt_id))
        body = self._bodies.get(ckpt_id)
        if body is not None:
            problems += self._chain(ckpt_id, body)
        return problems

    def own(self, ckpt_id: int) -> list[Problem]:
        if ckpt_id not in self._own:
            problems: list[Problem] = []
            try:
                self._check_own(ckpt_id, problems)
            except CnrError as e:
                problems.append(Problem(ckpt_id, getattr(e, "path", "") or manifest_path(ckpt_id), str(e)))
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                # A manifest that carries a valid seal but not the expected structure.
                problems.append(Problem(ckpt_id, manifest_path(ckpt_id),
                                        f"the manifest is malformed ({type(e).__name__}: {e})"))
            self._own[ckpt_id] = problems
        return self._own[ckpt_id]

    def _check_own(self, ckpt_id: int, problems: list[Problem]) -> None:
        mpath = manifest_path(ckpt_id)
        if not self.storage.exists(mpath):
            problems.append(Problem(ckpt_id, mpath, "is missing: the checkpoint is not committed"))
            return
        try:
            body = load_manifest(self.storage, ckpt_id)
        except CorruptCheckpointError as e:
            problems.append(Problem(ckpt_id, e.path or mpath, _strip_path(str(e), e.path or mpath)))
            return
        if "chain" in body:  # version 2: load_manifest gave it the links it lacked
            sealed = seal({k: v for k, v in body.items() if k not in ("base", "depth")}, version=2)
        else:
            sealed = seal(body)
        if self.storage.read(mpath) != sealed:
            problems.append(Problem(ckpt_id, mpath, "differs from the sealed form of its body: a byte outside "
                                                    "the sealed body was changed"))
        try:
            check_manifest(body, mpath)
        except CorruptCheckpointError as e:
            problems.append(Problem(ckpt_id, mpath, _strip_path(str(e), mpath)))
            return
        self._bodies[ckpt_id] = body
        self._check_body(ckpt_id, body, problems)

    def _check_body(self, ckpt_id: int, body: Mapping[str, Any], problems: list[Problem]) -> None:
        mpath = manifest_path(ckpt_id)
        ranks = body["ranks"]
        if [r.get("rank") for r in ranks] != list(range(body["world_size"])):
            problems.append(Problem(ckpt_id, mpath, f"has reports of ranks {[r.get('rank') for r in ranks]} for a "
                                                    f"world size of {body['world_size']}"))
        if sum(int(r["nbytes"]) for r in ranks) != body["nbytes"]:
            problems.append(Problem(ckpt_id, mpath, "its total bytes do not add up to its rank files' bytes"))
        for report in ranks:
            self._check_rank(ckpt_id, body, report, problems)

    def _read_chunks(self, ckpt_id: int, report: Mapping[str, Any], problems: list[Problem]) -> bytearray | None:
        """The payload, each chunk checked (a problem per bad chunk, cut or padded to its size so that the blobs
        after it stay at their offsets); None if a chunk is missing."""
        data = bytearray()
        for chunk in chunks_of(report):
            try:
                got = self.storage.read(chunk.path)
            except CheckpointNotFoundError:
                problems.append(Problem(ckpt_id, chunk.path, "is missing"))
                return None
            try:
                check_bytes(chunk.path, got, chunk.nbytes, chunk.xxh3)
            except CorruptCheckpointError as e:
                problems.append(Problem(ckpt_id, chunk.path, str(e).removeprefix(chunk.path + " ")))
            data += got[: chunk.nbytes] + bytes(max(0, chunk.nbytes - len(got)))
        return data

    def _check_rank(
        self, ckpt_id: int, body: Mapping[str, Any], report: Mapping[str, Any], problems: list[Problem]
    ) -> None:
        file = check_relative(report["file"])
        if posixpath.dirname(file) != ckpt_dir(ckpt_id):
            problems.append(Problem(ckpt_id, manifest_path(ckpt_id),
                                    f"names rank file {file}, outside {ckpt_dir(ckpt_id)}/"))
            return
        data = self._read_chunks(ckpt_id, report, problems)
        if data is None:
            return
        want = int(report["nbytes"])

        blob_problems: list[str] = []
        sound: set[str] = set()
        spans = []
        for name, meta in report["blobs"].items():
            msg = _check_blob(name, meta, data, want)
            if msg:
                blob_problems.append(msg)
            else:
                sound.add(name)
                spans.append((int(meta["offset"]), int(meta["offset"]) + int(meta["nbytes"]), name))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                blob_problems.append(f"blobs {a!r} and {b!r} overlap")
        for msg in blob_problems[:_MAX_BLOB_PROBLEMS]:
            problems.append(Problem(ckpt_id, file, msg))
        if len(blob_problems) > _MAX_BLOB_PROBLEMS:
            problems.append(Problem(ckpt_id, file, f"... and {len(blob_problems) - _MAX_BLOB_PROBLEMS} more "
                                                   "blob problems"))

        refs = _References(ckpt_id, file, report, data, sound, problems)
        shapes = body["tables"]
        for table, entries in report["tables"].items():
            if table not in shapes:
                refs.problem(f"holds entries of table '{table}', which the manifest does not list")
                continue
            for entry in entries:
                refs.entry(table, entry, shapes[table])
        for table, name in report["replicated_tables"].items():
            refs.blob(name, f"replicated table '{table}'")
        for pname, name in report["dense"].items():
            refs.blob(name, f"dense parameter '{pname}'")
        for what in ("dense_optimizer", "rng"):
            refs.tree(report.get(what), what)
        for ename, tree in report.get("extra", {}).items():
            refs.tree(tree, f"extra state '{ename}'")

    # ------------------------------------------------------------------ chains

    def _chain(self, ckpt_id: int, body: Mapping[str, Any]) -> list[Problem]:
        """Problems of the members ``ckpt_id``'s links lead to: missing, unsound, or not fitting the links."""
        problems = []
        node = body
        while node["kind"] != "baseline" or node["id"] != node["base"]:
            mpath = manifest_path(node["id"])
            parent = node.get("parent")
            if node["kind"] == "baseline" or type(parent) is not int or not 0 <= parent < node["id"]:
                return problems + [Problem(ckpt_id, mpath, f"checkpoint {node['id']} ({node['kind']}, base "
                                                           f"{node['base']}) has parent {parent!r}, which cannot "
                                                           "lead back to its baseline")]
            own = self.own(parent)
            if own:
                first = own[0]
                if first.message.startswith("is missing: the checkpoint is not committed"):
                    msg = f"checkpoint {ckpt_id} needs checkpoint {parent}, which is not committed"
                else:
                    msg = f"checkpoint {ckpt_id} needs checkpoint {parent}, which does not verify: {first.message}"
                return problems + [Problem(ckpt_id, first.path, msg)]
            up = self._bodies[parent]
            if (up["base"], up["depth"]) != (node["base"], node["depth"] - 1):
                return problems + [Problem(ckpt_id, manifest_path(parent),
                                           f"checkpoint {ckpt_id} needs checkpoint {parent} (base {up['base']}, depth "
                                           f"{up['depth']}), which does not fit the link of checkpoint {node['id']} "
                                           f"(base {node['base']}, depth {node['depth']})")]
            if up["tables"] != body["tables"]:
                problems.append(Problem(ckpt_id, manifest_path(parent),
                                        f"checkpoint {ckpt_id} and its chain member {parent} have different tables"))
            node = up
        if node["depth"] != 0 or node.get("parent") is not None:
            problems.append(Problem(ckpt_id, manifest_path(node["id"]),
                                    f"baseline {node['id']} has depth {node['depth']} and parent {node.get('parent')!r}"))
        return problems


def _strip_path(message: str, path: str) -> str:
    return message[len(path) :].lstrip(" :") if message.startswith(path) else message


def _check_blob(name: str, meta: Mapping[str, Any], data: bytes, file_nbytes: int) -> str | None:
    """Why this blob is unsound, or None."""
    try:
        offset, nbytes = int(meta["offset"]), int(meta["nbytes"])
        shape = [int(s) for s in meta["shape"]]
        dtype = DTYPES.get(meta["dtype"])
        digest = meta["xxh3"]
    except (KeyError, TypeError, ValueError) as e:
        return f"blob {name!r} is described incompletely ({type(e).__name__}: {e})"
    if dtype is None:
        return f"blob {name!r} has dtype {meta['dtype']!r}, which is never written"
    if offset < 0 or nbytes < 0 or any(s < 0 for s in shape):
        return f"blob {name!r} has a negative offset, size or dimension"
    if math.prod(shape) * dtype.itemsize != nbytes:
        return f"blob {name!r} is {nbytes} bytes, but {meta['dtype']} {shape} needs {math.prod(shape) * dtype.itemsize}"
    if offset + nbytes > file_nbytes:
        return f"blob {name!r} spans bytes [{offset}, {offset + nbytes}), past the file's {file_nbytes} bytes"
    if offset + nbytes > len(data):
        return f"blob {name!r} spans bytes [{offset}, {offset + nbytes}), past the end of the file (truncated)"
    if checksum(memoryview(data)[offset : offset + nbytes]) != digest:
        return f"blob {name!r} does not match its checksum"
    return None


class _References:
    """Checks that what a rank report refers to exists and is consistent."""

    def __init__(self, ckpt_id: int, file: str, report: Mapping[str, Any], data: bytes, sound: set[str],
                 problems: list[Problem]) -> None:
        self.ckpt_id, self.file, self.report, self.data = ckpt_id, file, report, data
        self.sound, self.problems = sound, problems

    def problem(self, msg: str) -> None:
        self.problems.append(Problem(self.ckpt_id, self.file, msg))

    def blob(self, name: Any, what: str) -> bool:
        """True if blob ``name`` is described and sound; a problem if it is not described."""
        if not isinstance(name, str) or name not in self.report["blobs"]:
            self.problem(f"{what} refers to blob {name!r}, which the manifest does not describe")
            return False
        return name in self.sound

    def tensor(self, name: str) -> torch.Tensor:
        meta = self.report["blobs"][name]
        start, n = int(meta["offset"]), int(meta["nbytes"])
        raw = bytearray(self.data[start : start + n])
        t = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        return t.view(DTYPES[meta["dtype"]]).reshape([int(s) for s in meta["shape"]])

    def tree(self, tree: Any, what: str) -> None:
        unflatten_state(tree, lambda name: self.blob(name, what))

    def entry(self, table: str, entry: Mapping[str, Any], shape: list[int]) -> None:
        """Checks one table entry."""
        rows, cols = [int(v) for v in entry["rows"]], [int(v) for v in entry["cols"]]
        where = f"an entry of table '{table}' (rows {rows}, cols {cols})"
        if not (0 <= rows[0] < rows[1] <= shape[0] and 0 <= cols[0] < cols[1] <= shape[1]):
            self.problem(f"{where} lies outside the table's {shape[0]} x {shape[1]}")
            return
        n_rows = rows[1] - rows[0]
        count = n_rows
        if entry.get("encoding") not in ("rows", "full"):
            self.problem(f"{where} has encoding {entry.get('encoding')!r}")
        if "ids" in entry:
            ids = entry["ids"]
            count = int(ids["count"])
            if self.blob(ids["blob"], f"{where}: row ids"):
                try:
                    decoded = decode_ids(ids["kind"], self.tensor(ids["blob"]), n_rows)
                except (ValueError, RuntimeError) as e:
                    self.problem(f"{where}: row ids do not decode ({e})")
                else:
                    if decoded.numel() != count or (decoded.numel() and int(decoded[-1]) >= n_rows):
                        self.problem(f"{where}: row ids do not match their count or range")
        elif entry.get("encoding") == "rows":
            self.problem(f"{where} stores selected rows without row ids")
        weights = entry["weights"]
        names = weights["blobs"]
        present = {k: n for k, n in names.items() if self.blob(n, f"{where}: weights {k}")}
        if len(present) == len(names):
            try:
                enc = EncodedRows.from_tensors({k: self.tensor(n) for k, n in present.items()}, weights["meta"])
            except CnrError as e:
                self.problem(f"{where}: encoded rows are inconsistent ({e})")
            else:
                if enc.num_rows != count:
                    self.problem(f"{where} stores {enc.num_rows} rows for {count} row ids")
                if enc.dim != cols[1] - cols[0]:
                    self.problem(f"{where} stores rows of {enc.dim} values for {cols[1] - cols[0]} columns")
        for j, s in enumerate(entry.get("states", [])):
            if self.blob(s["blob"], f"{where}: optimizer state {j}"):
                state_shape = self.report["blobs"][s["blob"]]["shape"]
                got = int(state_shape[0]) if state_shape else -1
                if got != count:
                    self.problem(f"{where}: optimizer state {j} has {got} rows for {count} row ids")


def _check_index(storage: Storage, committed: set[int]) -> list[Problem]:
    if not storage.exists(INDEX):
        return []
    raw = storage.read(INDEX)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [Problem(None, INDEX, f"is not valid JSON ({e})")]
    if not isinstance(doc, dict) or doc.get("format") != "cnr-index" or not isinstance(doc.get("committed"), list):
        return [Problem(None, INDEX, 'is not a cnr_torchrec index ({"format": "cnr-index", "committed": [...]})')]
    ids = doc["committed"]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return [Problem(None, INDEX, f"lists ids that are not integers: {ids}")]
    problems = []
    if ids != sorted(set(ids)):
        problems.append(Problem(None, INDEX, f"lists ids out of order or twice: {ids}"))
    for i in sorted(set(ids) - committed):
        problems.append(Problem(None, INDEX, f"lists checkpoint {i}, which is not committed"))
    return problems


def verify_checkpoint(storage: Storage, ckpt_id: int) -> list[Problem]:
    """Checks one checkpoint and the members of its chain. An empty list means sound."""
    return _Verifier(storage).checkpoint(ckpt_id)


def verify_root(root: str, storage_options: dict | None = None, ids: list[int] | None = None) -> list[Problem]:
    """Checks every committed checkpoint under ``root`` (or those in ``ids``), and index.json.

    Returns:
        Every problem found, each naming its file; an empty list means sound.

    Raises:
        CheckpointNotFoundError: the root does not exist or holds no committed checkpoint,
            or an id in ``ids`` is not committed.
        ConfigError: the storage plugin refused the root or the options.
    """
    storage = open_storage(root, storage_options)
    try:
        try:
            committed = committed_ids(storage)
        except CorruptCheckpointError as e:  # stores that cannot list read the index to find checkpoints
            return [Problem(None, e.path or INDEX, _strip_path(str(e), e.path or INDEX))]
        if ids is None:
            resolve_id(storage)  # raises when nothing is committed
            targets = committed
        else:
            targets = [resolve_id(storage, i) for i in ids]
        verifier = _Verifier(storage)
        problems = []
        for cid in targets:
            problems += verifier.checkpoint(cid)
        if ids is None:
            problems += _check_index(storage, set(committed))
        return problems
    finally:
        storage.close()
