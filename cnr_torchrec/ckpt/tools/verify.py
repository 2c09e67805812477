"""Offline integrity check of a checkpoint root: every byte the manifests vouch for, and every reference.

For each committed checkpoint: the manifest loads, matches its seal and passes the schema
(:func:`~cnr_torchrec.ckpt.format.schema.check_manifest`, which checks everything a manifest
says about itself: ranges, shapes, dtypes, references), its parts pass the same checks a restore
makes as it reads them (:func:`~cnr_torchrec.ckpt.format.schema.check_part`: the index's line, its
``shards`` and each part's entries against them) and together
(:func:`~cnr_torchrec.ckpt.format.structure.check_parts`: no entry twice, a baseline that covers
every table, the replicated tables and per-rank state the index says), and is byte for byte the sealed form
of its body (so even a flipped whitespace byte is caught). What the schema cannot see is
checked here, from the bytes: every rank file lies in its checkpoint's directory, and each
chunk exists with the size and digest the manifest gives (xxh3; on a root with a key, the
manifest's HMAC-SHA256 and the chunk's keyed BLAKE2b, :mod:`~cnr_torchrec.ckpt.format.bytes.integrity`);
every blob matches its own xxh3 and overlaps no other; every entry's row ids decode to the
count it claims and its encoded rows are consistent; a delta's chain members exist, verify,
link up and have its tables; and the dense optimizer's state is of a form this version
restores (dense_optim.SavedDenseOptimizer).
index.json, when present, must be a valid index listing only committed checkpoints.

Nothing is unpickled: manifests are JSON and payloads are raw bytes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from cnr_torchrec.ckpt.format.bytes.integrity import RootKey, check_chunk
from cnr_torchrec.ckpt.format.bytes.payload import DTYPES, checksum
from cnr_torchrec.ckpt.format.bytes.rows import as_rows
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    INDEX,
    check_files_inside,
    committed_ids,
    load_manifest,
    manifest_path,
    seal,
    walk_chain,
)
from cnr_torchrec.ckpt.format.manifest import Blob, Manifest, Payload, RankReport, TableEntry
from cnr_torchrec.ckpt.format.row_ids import stored_modes, stored_offsets
from cnr_torchrec.ckpt.format.schema import parse_json
from cnr_torchrec.ckpt.format.structure import check_parts
from cnr_torchrec.ckpt.live.dense_optim import describe
from cnr_torchrec.ckpt.tools.root import open_storage, resolve_id
from cnr_torchrec.errors import CheckpointNotFoundError, CnrError, CorruptCheckpointError, UnsafeCheckpointError
from cnr_torchrec.ops import row_crc32c
from cnr_torchrec.quant import rebuild

__all__ = ["Problem", "verify_checkpoint", "verify_root"]

log = logging.getLogger(__name__)

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
        self._manifests: dict[int, Manifest] = {}
        self.dense_optimizers: dict[int, dict[str, str | None] | None] = {}  # by checkpoint: describe()'s

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, ckpt_id: int) -> list[Problem]:
        """This checkpoint's own problems, then those of its chain."""
        problems = list(self.own(ckpt_id))
        manifest = self._manifests.get(ckpt_id)
        if manifest is not None:
            problems += self._chain(manifest)
        return problems

    def own(self, ckpt_id: int) -> list[Problem]:
        if ckpt_id not in self._own:
            problems: list[Problem] = []
            try:
                self._check_own(ckpt_id, problems)
            except CnrError as e:
                problems.append(Problem(ckpt_id, getattr(e, "path", "") or manifest_path(ckpt_id), str(e)))
            self._own[ckpt_id] = problems
        return self._own[ckpt_id]

    def _check_own(self, ckpt_id: int, problems: list[Problem]) -> None:
        mpath = manifest_path(ckpt_id)
        if not self.storage.exists(mpath):
            problems.append(Problem(ckpt_id, mpath, "is missing: the checkpoint is not committed"))
            return
        try:
            manifest = load_manifest(self.storage, ckpt_id)  # the seal and the schema
        except CorruptCheckpointError as e:
            problems.append(Problem(ckpt_id, e.path or mpath, _strip_path(str(e), e.path or mpath)))
            return
        body = manifest.body
        raw = self.storage.read(mpath)
        if "chain" in body:  # version 2: load_manifest gave it the links it lacked
            sealed = seal({k: v for k, v in body.items() if k not in ("base", "depth")}, version=2,
                          key=self.storage.key)
        else:
            sealed = seal(dict(body), version=json.loads(raw)["version"], key=self.storage.key)
        if raw != sealed:
            problems.append(Problem(ckpt_id, mpath, "differs from the sealed form of its body: a byte outside "
                                                    "the sealed body was changed"))
        try:
            check_files_inside(manifest)
        except UnsafeCheckpointError as e:
            problems.append(Problem(ckpt_id, mpath, _strip_path(str(e), mpath)))
            return
        self._manifests[ckpt_id] = manifest
        reports = []
        for r in range(len(manifest.ranks)):  # a format 7 index reads each rank's part here, checked as it loads
            try:
                reports.append(manifest.ranks[r])
            except CnrError as e:
                where = getattr(e, "path", "") or mpath
                problems.append(Problem(ckpt_id, where, _strip_path(str(e), where)))
        if len(reports) == len(manifest.ranks):
            try:
                self.dense_optimizers[ckpt_id] = describe(reports[0].dense_optimizer)
            except CorruptCheckpointError as e:
                problems.append(Problem(ckpt_id, mpath, str(e)))
            try:  # what spans the parts, as a restore that reads them all checks it (format/structure.py)
                check_parts(manifest, reports)
            except CorruptCheckpointError as e:
                problems.append(Problem(ckpt_id, mpath, _strip_path(str(e), mpath)))
        for report in reports:
            self._check_rank(ckpt_id, report, problems)

    def _read_chunks(self, ckpt_id: int, payload: Payload, problems: list[Problem]) -> bytearray | None:
        """The payload, each chunk checked (a problem per bad chunk, cut or padded to its size so that the blobs
        after it stay at their offsets); None if a chunk is missing."""
        data = bytearray()
        for chunk in payload.chunks:
            try:
                got = self.storage.read(chunk.path)
            except CheckpointNotFoundError:
                problems.append(Problem(ckpt_id, chunk.path, "is missing"))
                return None
            try:
                check_chunk(self.storage.key, chunk.path, got, chunk.nbytes, chunk.digest, chunk.keyed)
            except CorruptCheckpointError as e:
                problems.append(Problem(ckpt_id, chunk.path, str(e).removeprefix(chunk.path + " ")))
            data += got[: chunk.nbytes] + bytes(max(0, chunk.nbytes - len(got)))
        return data

    def _check_rank(self, ckpt_id: int, report: RankReport, problems: list[Problem]) -> None:
        """The bytes of one rank's payload: chunks, then blobs, then what the entries' bytes must decode to."""
        data = self._read_chunks(ckpt_id, report.payload, problems)
        if data is None:
            return
        # Every one, so that a count of problems is one; `cnr verify` shortens what it prints of a damaged file.
        problems += [Problem(ckpt_id, report.file, msg) for msg in _blob_problems(report.blobs, data)]
        sound = {name for name, blob in report.blobs.items() if _blob_sound(blob, data)}
        entries = _Entries(ckpt_id, report, data, sound, problems)
        for table, entry in report.entries():
            entries.check(table, entry)

    # ------------------------------------------------------------------ chains

    def _chain(self, manifest: Manifest) -> list[Problem]:
        """Problems of the members ``manifest``'s links lead to: missing, unsound, or not fitting the links."""
        problems = []

        def load(parent: int) -> Manifest:
            own = self.own(parent)
            if own:
                first = own[0]
                if first.message.startswith("is missing: the checkpoint is not committed"):
                    msg = f"checkpoint {manifest.id} needs checkpoint {parent}, which is not committed"
                else:
                    msg = f"checkpoint {manifest.id} needs checkpoint {parent}, which does not verify: {first.message}"
                raise CorruptCheckpointError(msg, path=first.path)
            return self._manifests[parent]

        try:
            chain = walk_chain(manifest, load)
        except CorruptCheckpointError as e:
            return [Problem(manifest.id, e.path or manifest_path(manifest.id), _strip_path(str(e), e.path or ""))]
        for member in chain[:-1]:
            if member.tables != manifest.tables:
                problems.append(Problem(manifest.id, manifest_path(member.id), f"checkpoint {manifest.id} and its "
                                                                               f"chain member {member.id} have "
                                                                               "different tables"))
        return problems


def _strip_path(message: str, path: str) -> str:
    return message[len(path) :].lstrip(" :") if path and message.startswith(path) else message


def _blob_sound(blob: Blob, data: bytes) -> bool:
    return blob.end <= len(data) and checksum(memoryview(data)[blob.offset : blob.end]) == blob.xxh3


def _blob_problems(blobs: Mapping[str, Blob], data: bytes) -> list[str]:
    """What is wrong with the blobs' bytes (the schema checked their descriptions): short, changed, overlapping."""
    out = []
    for name, blob in blobs.items():
        if blob.end > len(data):
            out.append(f"blob {name!r} spans bytes [{blob.offset}, {blob.end}), past the end of the file (truncated)")
        elif not _blob_sound(blob, data):
            out.append(f"blob {name!r} does not match its checksum")
    spans = sorted((b.offset, b.end, name) for name, b in blobs.items())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            out.append(f"blobs {a!r} and {b!r} overlap")
    return out


class _Entries:
    """Checks what a rank's entries decode to, from the bytes of its sound blobs: row ids that match their
    count and range, row-mode bitmaps that match their entry, encoded rows their codec accepts, and rows that
    match their CRC-32C."""

    def __init__(self, ckpt_id: int, report: RankReport, data: bytes, sound: set[str],
                 problems: list[Problem]) -> None:
        self.ckpt_id, self.report, self.data = ckpt_id, report, data
        self.sound, self.problems = sound, problems

    def problem(self, msg: str) -> None:
        self.problems.append(Problem(self.ckpt_id, self.report.file, msg))

    def tensor(self, name: str) -> torch.Tensor:
        blob = self.report.blobs[name]
        raw = bytearray(self.data[blob.offset : blob.end])
        t = torch.frombuffer(raw, dtype=torch.uint8) if blob.nbytes else torch.empty(0, dtype=torch.uint8)
        return t.view(DTYPES[blob.dtype]).reshape(blob.shape)

    def check(self, table: str, entry: TableEntry) -> None:
        where = f"an entry of table '{table}' (rows {list(entry.rows)}, cols {list(entry.cols)})"
        if entry.ids is None and entry.encoding == "rows":
            self.problem(f"{where} stores selected rows without row ids")
        ids = entry.ids
        if ids is not None and ids.blob in self.sound:
            try:
                stored_offsets(entry, self.tensor, f"{where}: ")
            except CorruptCheckpointError as e:
                self.problem(str(e))
        if entry.whole is not None and entry.whole.blob in self.sound:  # format 6: which rows are stored whole
            try:
                stored_modes(entry, self.tensor, f"{where}: ")
            except CorruptCheckpointError as e:
                self.problem(str(e))
        names = entry.coded.blobs
        if all(n in self.sound for n in names.values()):
            try:
                rebuild({k: self.tensor(n) for k, n in names.items()}, dict(entry.coded.meta))
            except CnrError as e:
                self.problem(f"{where}: encoded rows are inconsistent ({e})")
        checks = entry.checks
        if checks is not None and all(n in self.sound for n in [*entry.row_blobs, checks.blob]):  # format 5
            got = row_crc32c([as_rows(self.tensor(n)) for n in entry.row_blobs], checks.rows)
            bad = int((got != self.tensor(checks.blob)).sum())
            if bad:
                self.problem(f"{where}: {bad} groups of {checks.rows} stored rows do not match their CRC-32C")


def _check_index(storage: Storage, committed: set[int]) -> list[Problem]:
    if not storage.exists(INDEX):
        return []
    raw = storage.read(INDEX)
    try:
        doc = parse_json(raw, INDEX)
    except CorruptCheckpointError as e:
        return [Problem(None, INDEX, _strip_path(str(e), INDEX))]
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


def verify_root(root: str, storage_options: dict | None = None, ids: list[int] | None = None, *,
                dense_optimizers: dict[int, dict[str, str | None] | None] | None = None,
                key: RootKey | None = None) -> list[Problem]:
    """Checks every committed checkpoint under ``root`` (or those in ``ids``), and index.json.

    Args:
        key: the root's key, if it has one: every manifest must carry its MAC and every chunk its keyed digest.
        dense_optimizers: if given, filled with what dense optimizer state each checkpoint whose manifest
            loads holds (chain members included): None, or ``{"kind", "class"}`` (dense_optim.describe).

    Returns:
        Every problem found, each naming its file; an empty list means sound.

    Raises:
        CheckpointNotFoundError: the root does not exist or holds no committed checkpoint,
            or an id in ``ids`` is not committed.
        ConfigError: the storage plugin refused the root or the options.
    """
    storage = open_storage(root, storage_options, key)
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
        if dense_optimizers is not None:
            dense_optimizers.update(sorted(verifier.dense_optimizers.items()))
        return problems
    finally:
        storage.close()
