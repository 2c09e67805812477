"""Commit files: sealed JSON manifests as commit markers, chains of them, and the index of committed ids.

Layout under the root::

    ckpt-00000003/
        rank-00000.bin      payload of rank 0 (blobs back to back), its first chunk
        rank-00000.1.bin    its second chunk, and so on (format/bytes/chunks.py)
        rank-00000.json     rank 0's part: its report (format 7; format/parts.py)
        rank-00001.bin
        rank-00001.json
        manifest.json       the index, written last, atomically, by rank 0: the commit marker
    index.json              committed ids, rewritten after each commit (for stores that cannot list)

A manifest is one JSON object ``{"format", "version", "xxh3", "body"}``, ``body`` last;
``xxh3`` covers the body's text exactly as it stands in the file, so an edited or
bit-flipped manifest is caught even when it still parses, and checking it needs no second
serialization of the body. On a root with a key the header also holds ``hmac_sha256`` over the
same text (:mod:`~cnr_torchrec.ckpt.format.bytes.integrity`), checked by every read.

A body links to its chain by ``parent`` (the checkpoint whose restored state it applies on),
``base`` (the chain's baseline) and ``depth`` (links from the baseline: 0 for a baseline), so
its size does not grow with the chain; :func:`walk_chain` follows the links back. Version 2
bodies listed the whole chain instead; they are read, and given the links, on load. Version 4
payloads are chunked (each rank report lists its chunks); a version 3 report's payload is one file.
"""

from __future__ import annotations

import bisect
import json
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

from cnr_torchrec.ckpt.format.bytes.integrity import RootKey, check_seal, seal_fields
from cnr_torchrec.ckpt.format.bytes.payload import checksum
from cnr_torchrec.ckpt.format.bytes.storage import Storage, check_relative
from cnr_torchrec.ckpt.format.manifest import Manifest, part_path_of, rank_file_of
from cnr_torchrec.ckpt.format.parts import with_parts
from cnr_torchrec.ckpt.format.schema import check_manifest, parse_json
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "FORMAT",
    "INDEX",
    "VERSION",
    "ckpt_dir",
    "ckpt_id_of",
    "manifest_path",
    "rank_file",
    "part_path",
    "seal",
    "load_manifest",
    "read_body",
    "committed_ids",
    "existing_dir_ids",
    "write_index",
    "walk_chain",
    "chain_ids",
    "Commit",
    "newest_state_first",
    "check_files_inside",
    "remove_partial",
    "remove_uncommitted",
]

FORMAT = "cnr-checkpoint"
# 7: the manifest is an index, each rank's report a part of its own (format/parts.py); 6: a residual entry may
# store some rows whole (its "whole" bitmap); 5: a CRC-32C per stored row (range
# reads check what they read); 4: chunked payloads; 3: chain links (parent, base, depth) instead of chain
# lists; 2: XXH3 checksums (1: sha256)
VERSION = 7
INDEX = "index.json"
_DIR_RE = re.compile(r"^ckpt-(\d{8})$")


def ckpt_dir(ckpt_id: int) -> str:
    return f"ckpt-{ckpt_id:08d}"


def manifest_path(ckpt_id: int) -> str:
    return f"{ckpt_dir(ckpt_id)}/manifest.json"


def rank_file(ckpt_id: int, rank: int) -> str:
    return rank_file_of(ckpt_id, rank)


def part_path(ckpt_id: int, rank: int) -> str:
    """Rank ``rank``'s part of checkpoint ``ckpt_id`` (format 7; :mod:`~cnr_torchrec.ckpt.format.parts`)."""
    return part_path_of(ckpt_id, rank)


def ckpt_id_of(path: str) -> int | None:
    """The checkpoint a file belongs to (``ckpt-00000007/rank-00001.bin`` -> 7); None for other paths."""
    m = _DIR_RE.match(path.split("/", 1)[0]) if path else None
    return int(m.group(1)) if m else None


_BODY_KEY = b'"body": '


def seal(body: dict[str, Any], version: int = VERSION, key: RootKey | None = None) -> bytes:
    """The bytes of a manifest file for ``body``: a header, then the body's JSON, which the header's xxh3 covers
    (and, with the root's ``key``, its HMAC-SHA256). Compact JSON since format 7 (indented before)."""
    text = (json.dumps(body, indent=1, allow_nan=False) if version < 7 else
            json.dumps(body, separators=(",", ":"), allow_nan=False)).encode()
    head = json.dumps({"format": FORMAT, "version": version, "xxh3": checksum(text),
                       **seal_fields(key, text)}).encode()
    return head[:-1] + b", " + _BODY_KEY + text + b"}"


def _body_text(raw: bytes | bytearray) -> bytes | bytearray:
    """The body's text in a sealed manifest: from the first ``"body": `` (the header holds none) to the last brace."""
    start = raw.find(_BODY_KEY)
    end = raw.rfind(b"}")
    return raw[start + len(_BODY_KEY) : end] if 0 <= start < end else b""


def load_manifest(storage: Storage, ckpt_id: int) -> Manifest:
    """Reads one manifest, checks its seal and its schema, and returns it typed.

    Raises:
        CheckpointNotFoundError: the checkpoint was never committed.
        CorruptCheckpointError: the manifest does not parse, does not match its checksum, or breaks the
            schema (:func:`~cnr_torchrec.ckpt.format.schema.check_manifest`).
        UnsafeCheckpointError: it names a dtype that is never written.
    """
    return with_parts(check_manifest(read_body(storage, ckpt_id), manifest_path(ckpt_id)), storage)


def read_body(storage: Storage, ckpt_id: int) -> dict[str, Any]:
    """The body of one sealed manifest, as JSON, once its seal and version are checked (not its schema).

    Raises:
        CheckpointNotFoundError: the checkpoint was never committed.
        CorruptCheckpointError: the manifest does not parse, is of an unreadable version, does not match
            its checksum, or describes another checkpoint.
    """
    path = manifest_path(ckpt_id)
    raw = storage.read(path)
    doc = parse_json(raw, path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "body" not in doc:
        raise CorruptCheckpointError(f"{path} is not a cnr_torchrec manifest", path=path)
    version = doc.get("version")
    if version not in _READABLE:
        if isinstance(version, int) and 0 < version < VERSION:
            how = ("it was written by an earlier cnr_torchrec (version 1 used sha256 checksums). Restore it with the "
                   "build that wrote it and save a new baseline with this one")
        else:
            how = "upgrade cnr_torchrec to read it"
        raise CorruptCheckpointError(
            f"{path} has format version {version!r}; this build reads versions 2 to {VERSION}: {how}.", path=path
        )
    body, text = doc["body"], _body_text(raw)
    if checksum(text) != doc.get("xxh3"):
        raise CorruptCheckpointError(f"{path} does not match its checksum; the checkpoint is corrupt", path=path)
    check_seal(storage.key, doc, text, path)
    if not isinstance(body, dict) or body.get("id") != ckpt_id:
        what = body.get("id") if isinstance(body, dict) else type(body).__name__
        raise CorruptCheckpointError(f"{path} describes checkpoint {what}, not {ckpt_id}", path=path)
    if version == 2:
        _links_from_chain(body, path)
    return body


_READABLE = (2, 3, 4, 5, 6, VERSION)


def _links_from_chain(body: dict[str, Any], path: str) -> None:
    """A version 2 body listed its chain; it gets the links a version 3 body holds."""
    chain = body.get("chain")
    if not (isinstance(chain, list) and chain and all(type(i) is int for i in chain)):
        raise CorruptCheckpointError(f"{path} has an invalid chain {chain!r}", path=path)
    body["base"], body["depth"] = chain[0], len(chain) - 1


def walk_chain(tip: Manifest, load: Callable[[int], Manifest]) -> list[Manifest]:
    """The manifests of ``tip``'s chain, baseline first, following ``parent`` links with ``load(id)``.

    Every member passed the schema as it was loaded; the walk checks the links between them:
    a parent older than its child, of the same ``base`` and one ``depth`` less, and an end at a
    baseline whose id is the ``base``. So a crafted or mixed-up manifest can neither loop nor
    splice chains together.

    Raises:
        CorruptCheckpointError: a link does not hold, or a member is not committed (names its manifest).
    """
    chain = [tip]
    node = tip
    while not node.is_baseline:
        parent = node.parent
        path = manifest_path(node.id)
        if parent is None or not 0 <= parent < node.id or node.depth < 1:
            raise CorruptCheckpointError(f"{path}: delta {node.id} has parent {parent!r} at depth "
                                         f"{node.depth}; a delta's parent is an older checkpoint", path=path)
        try:
            up = load(parent)
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(
                f"{manifest_path(parent)} is missing: checkpoint {tip.id} needs checkpoint {parent}, which is "
                "not committed", path=manifest_path(parent)) from None
        if up.base != node.base or up.depth != node.depth - 1:
            raise CorruptCheckpointError(
                f"{manifest_path(parent)}: checkpoint {parent} (base {up.base}, depth {up.depth}) does not fit "
                f"the chain of checkpoint {node.id} (base {node.base}, depth {node.depth})",
                path=manifest_path(parent))
        chain.append(up)
        node = up
    if node.id != node.base or node.depth != 0 or node.parent is not None:
        path = manifest_path(node.id)
        raise CorruptCheckpointError(f"{path}: baseline {node.id} has base {node.base}, depth "
                                     f"{node.depth} and parent {node.parent!r}; a baseline is its own "
                                     "base, at depth 0, with no parent", path=path)
    return chain[::-1]


class Commit(Protocol):
    """What :func:`newest_state_first` reads of a committed checkpoint (a :class:`Manifest`, a retention entry)."""

    @property
    def id(self) -> int: ...

    @property
    def equals(self) -> int | None: ...


_C = TypeVar("_C", bound=Commit)


def newest_state_first(ids: Iterable[int], load: Callable[[int], _C | None]) -> Iterator[_C]:
    """Committed checkpoints, newest state first: the one order restore and retention call "newest".

    Ids grow with every commit, so the checkpoint committed last holds the newest state, whatever
    its step: a job that goes on from an older step (``restore(step=...)``, a fallback past corrupt
    checkpoints, a fresh start into a used root) writes the newest branch. One exception: a
    compacted baseline (``equals`` = the tip it reproduces) holds its tip's state, so it comes
    right before that tip, after the deltas committed after the tip (older ids than it, newer state).

    Lazy, newest first, so that a caller that stops at the first sound checkpoint loads one manifest.

    Args:
        ids: the committed ids, in any order (all of them: a compacted baseline is placed by the ids
            that lie between its tip and itself, loaded or not).
        load: the checkpoint of an id, or None to leave it out (collected meanwhile, found unsound);
            called once per id, newest id first. Whatever it raises propagates.

    Returns:
        An iterator over what ``load`` returned, newest state first.
    """
    order = sorted(set(ids))
    deferred: list[_C] = []  # compacted baselines waiting for their tip, by ``equals`` ascending
    for cid in reversed(order):
        while deferred and (deferred[-1].equals or 0) >= cid:  # deferred ones all have an ``equals``
            yield deferred.pop()
        c = load(cid)
        if c is None:
            continue
        tip = c.equals
        # Newer state than the tip lies between them when an id was committed after the tip and before c.
        if tip is not None and bisect.bisect_right(order, tip) < bisect.bisect_left(order, cid):
            bisect.insort(deferred, c, key=lambda d: d.equals or 0)
            continue
        yield c
    yield from reversed(deferred)


def check_files_inside(manifest: Manifest) -> None:
    """Every payload object ``manifest`` names lies in its own checkpoint's directory.

    Raises:
        UnsafeCheckpointError: a rank file is absolute, climbs out with ``..``, or lies elsewhere under the
            root (a crafted manifest aiming a read, or a later collection, at another checkpoint's files).
    """
    if manifest.version >= 7:
        return  # each part's payload is its rank's file by rule, which check_part enforces when it is read
    home = ckpt_dir(manifest.id)
    for report in manifest.ranks:
        for path in report.payload.files:
            if posixpath.dirname(check_relative(path)) != home:
                raise UnsafeCheckpointError(
                    f"{manifest_path(manifest.id)} names rank file {path!r}, outside {home}/. The manifest was "
                    "crafted or edited; refusing it. Restore another checkpoint with restore(step=...).")


def committed_ids(storage: Storage) -> list[int]:
    """Ids of the checkpoints whose manifest exists, ascending (manifests are not checked here)."""
    dirs = storage.list_dirs()
    if dirs is not None:
        ids = [int(m.group(1)) for d in dirs if (m := _DIR_RE.match(d))]
        return [i for i in ids if storage.exists(manifest_path(i))]
    # Stores that cannot list: the index, plus any commit that landed after the index was last written.
    try:
        ids = [int(i) for i in parse_json(storage.read(INDEX), INDEX).get("committed", [])]
    except CheckpointNotFoundError:
        ids = []
    except (CorruptCheckpointError, ValueError, AttributeError, TypeError):
        raise CorruptCheckpointError(
            f"{INDEX} is corrupt. This store cannot list directories, so the index is the catalog of "
            "committed checkpoints: rewrite it as {\"committed\": [ids...]} from the ckpt-*/manifest.json "
            "objects that exist, or restore it from a copy",
            path=INDEX,
        )
    ids = [i for i in ids if storage.exists(manifest_path(i))]
    nxt = (max(ids) + 1) if ids else 0
    while storage.exists(manifest_path(nxt)):
        ids.append(nxt)
        nxt += 1
    return sorted(set(ids))


def existing_dir_ids(storage: Storage) -> list[int]:
    """Ids of every checkpoint directory, committed or not (filesystem only; else the committed ones)."""
    dirs = storage.list_dirs()
    if dirs is None:
        return committed_ids(storage)
    return [int(m.group(1)) for d in dirs if (m := _DIR_RE.match(d))]


def write_index(storage: Storage, ids: list[int]) -> None:
    storage.write_atomic(INDEX, json.dumps({"format": "cnr-index", "committed": sorted(ids)}).encode())


def chain_ids(manifest: Manifest, manifests: Mapping[int, Manifest]) -> tuple[int, ...]:
    """``manifest``'s chain as ids, baseline first, as far as ``manifests`` hold its members (for listings;
    a restore checks every link with :func:`walk_chain`)."""
    ids = [manifest.id]
    node = manifest
    while node.parent is not None and node.parent in manifests and len(ids) <= manifest.depth:
        node = manifests[node.parent]
        ids.append(node.id)
    return tuple(ids[::-1])


def remove_partial(storage: Storage, ckpt_id: int, rank: int) -> None:
    """Removes ``rank``'s file of a write that did not commit; rank 0 also its manifest (first: a checkpoint
    the other ranks count as failed must not stay committed) and what is left of its directory."""
    if rank == 0:
        storage.delete(manifest_path(ckpt_id))
    storage.delete(rank_file(ckpt_id, rank))
    storage.delete(part_path(ckpt_id, rank))
    if rank == 0:
        storage.remove_dir(ckpt_dir(ckpt_id), [])


def remove_uncommitted(storage: Storage, newest: int, keep: Iterable[int] = ()) -> list[int]:
    """Deletes the directories of saves older than ``newest`` that never committed (a crash's leftovers),
    but those in ``keep`` (a compaction being written)."""
    committed = set(committed_ids(storage)) | set(keep)
    stale = [i for i in existing_dir_ids(storage) if i < newest and i not in committed]
    for i in stale:
        storage.remove_dir(ckpt_dir(i), [])
    return stale
