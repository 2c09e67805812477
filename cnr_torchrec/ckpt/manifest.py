"""Checkpoint manifests: sealed JSON commit markers, and the catalog of committed checkpoints.

Layout under the root::

    ckpt-00000003/
        rank-00000.bin      payload of rank 0 (blobs back to back)
        rank-00001.bin
        manifest.json       written last, atomically, by rank 0: the commit marker
    index.json              committed ids, rewritten after each commit (for stores that cannot list)

A manifest is one JSON object ``{"format", "version", "xxh3", "body"}``, ``body`` last;
``xxh3`` covers the body's text exactly as it stands in the file, so an edited or
bit-flipped manifest is caught even when it still parses, and checking it needs no second
serialization of the body.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cnr_torchrec.ckpt.payload import checksum
from cnr_torchrec.ckpt.storage import Storage
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = [
    "FORMAT",
    "VERSION",
    "ckpt_dir",
    "ckpt_id_of",
    "manifest_path",
    "rank_file",
    "seal",
    "load_manifest",
    "committed_ids",
    "write_index",
]

FORMAT = "cnr-checkpoint"
VERSION = 2  # 2: XXH3 checksums (1 had sha256)
INDEX = "index.json"
_DIR_RE = re.compile(r"^ckpt-(\d{8})$")


def ckpt_dir(ckpt_id: int) -> str:
    return f"ckpt-{ckpt_id:08d}"


def manifest_path(ckpt_id: int) -> str:
    return f"{ckpt_dir(ckpt_id)}/manifest.json"


def rank_file(ckpt_id: int, rank: int) -> str:
    return f"{ckpt_dir(ckpt_id)}/rank-{rank:05d}.bin"


def ckpt_id_of(path: str) -> int | None:
    """The checkpoint a file belongs to (``ckpt-00000007/rank-00001.bin`` -> 7); None for other paths."""
    m = _DIR_RE.match(path.split("/", 1)[0]) if path else None
    return int(m.group(1)) if m else None


_BODY_KEY = b'"body": '


def seal(body: dict[str, Any]) -> bytes:
    """The bytes of a manifest file for ``body``: a header, then the body's JSON, which the header's xxh3 covers."""
    text = json.dumps(body, indent=1, allow_nan=False).encode()
    head = json.dumps({"format": FORMAT, "version": VERSION, "xxh3": checksum(text)}).encode()
    return head[:-1] + b", " + _BODY_KEY + text + b"}"


def _body_text(raw: bytes | bytearray) -> bytes | bytearray:
    """The body's text in a sealed manifest: from the first ``"body": `` (the header holds none) to the last brace."""
    start = raw.find(_BODY_KEY)
    end = raw.rfind(b"}")
    return raw[start + len(_BODY_KEY) : end] if 0 <= start < end else b""


def load_manifest(storage: Storage, ckpt_id: int) -> dict[str, Any]:
    """Reads and checks one manifest.

    Raises:
        CheckpointNotFoundError: the checkpoint was never committed.
        CorruptCheckpointError: the manifest does not parse or does not match its checksum.
    """
    path = manifest_path(ckpt_id)
    raw = storage.read(path)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt", path=path) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "body" not in doc:
        raise CorruptCheckpointError(f"{path} is not a cnr_torchrec manifest", path=path)
    version = doc.get("version")
    if version != VERSION:
        if isinstance(version, int) and 0 < version < VERSION:
            how = ("it was written by an earlier cnr_torchrec (version 1 used sha256 checksums). Restore it with the "
                   "build that wrote it and save a new baseline with this one")
        else:
            how = "upgrade cnr_torchrec to read it"
        raise CorruptCheckpointError(
            f"{path} has format version {version!r}; this build reads version {VERSION}: {how}.", path=path
        )
    body = doc["body"]
    if checksum(_body_text(raw)) != doc.get("xxh3"):
        raise CorruptCheckpointError(f"{path} does not match its checksum; the checkpoint is corrupt", path=path)
    if body.get("id") != ckpt_id:
        raise CorruptCheckpointError(f"{path} describes checkpoint {body.get('id')}, not {ckpt_id}", path=path)
    return body


def committed_ids(storage: Storage) -> list[int]:
    """Ids of the checkpoints whose manifest exists, ascending (manifests are not checked here)."""
    dirs = storage.list_dirs()
    if dirs is not None:
        ids = [int(m.group(1)) for d in dirs if (m := _DIR_RE.match(d))]
        return [i for i in ids if storage.exists(manifest_path(i))]
    # Stores that cannot list: the index, plus any commit that landed after the index was last written.
    try:
        ids = [int(i) for i in json.loads(storage.read(INDEX)).get("committed", [])]
    except CheckpointNotFoundError:
        ids = []
    except (ValueError, AttributeError, TypeError):
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
