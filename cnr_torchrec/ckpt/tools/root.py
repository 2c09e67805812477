"""Opening a checkpoint root offline, and naming a committed checkpoint in it: what every tool does first.

Imports nothing of the other tools, so each of them (verify, offline, compact, dcp) and the ``cnr``
command can start from here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from cnr_torchrec.ckpt.format.bytes.integrity import RootKey
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import Commit, committed_ids, load_manifest, newest_state_first
from cnr_torchrec.errors import CheckpointNotFoundError, CnrError, ConfigError

__all__ = ["not_found_hint", "open_storage", "parse_storage_options", "resolve_id"]


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (``--storage-option``); a VALUE that parses as JSON (true, 3, {"a": 1}) is taken as
    such, else as a string.

    Raises:
        ConfigError: a pair without ``=`` or with an empty KEY.
    """
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--storage-option expects KEY=VALUE, got {pair!r}; e.g. --storage-option region=us-east-1"
            )
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def open_storage(root: str, storage_options: Mapping[str, Any] | None = None, key: RootKey | None = None) -> Storage:
    """A Storage on ``root`` (with the root's ``key``, if it has one), with a clear error when the root or the
    plugin is unusable.

    Raises:
        CheckpointNotFoundError: a local root that does not exist.
        ConfigError: the storage plugin refused the URL or the options.
    """
    if "://" not in root or root.startswith("fs://"):
        local = root.removeprefix("fs://")
        if not os.path.isdir(local):
            raise CheckpointNotFoundError(
                f"{root} does not exist or is not a directory; pass the checkpoint root "
                "(the directory that holds the ckpt-*/ directories and index.json)"
            )
    try:
        return Storage(root, dict(storage_options or {}), key=key)
    except CnrError:
        raise
    except Exception as e:  # plugins raise RuntimeError, ImportError, botocore errors...
        raise ConfigError(
            f"cannot open storage {root!r}: {type(e).__name__}: {e}. Check the URL and the --storage-option values"
        ) from None


def not_found_hint(storage: Storage) -> str:
    """What to add to a "no checkpoint under ROOT" message: a hint when ROOT looks like one checkpoint's
    own directory rather than the root above it, else the empty string."""
    local = storage.local_dir
    if local is not None and os.path.basename(os.path.normpath(local)).startswith("ckpt-"):
        return f"; {local} looks like one checkpoint's directory: pass its parent, the checkpoint root"
    return "; pass the checkpoint root (the directory that holds the ckpt-*/ directories and index.json)"


class _Unread(NamedTuple):
    """A committed checkpoint whose manifest does not load: placed by its id; whoever opens it names why."""

    id: int
    equals: None = None


def _newest(storage: Storage, ids: list[int]) -> int:
    """The id of the newest state, as restore orders them (a compacted baseline before its tip's later deltas)."""
    def load(i: int) -> Commit:
        try:
            return load_manifest(storage, i)
        except CnrError:
            return _Unread(i)

    return next(newest_state_first(ids, load)).id


def resolve_id(storage: Storage, ckpt_id: int | None = None) -> int:
    """``ckpt_id`` if it is committed, else, when ``ckpt_id`` is None, the newest committed state: the id
    ``Checkpointer.restore()`` would try first (by commit, a compacted baseline just before its tip).

    Raises:
        CheckpointNotFoundError: nothing committed, or ``ckpt_id`` is not committed.
    """
    ids = committed_ids(storage)
    if not ids:
        raise CheckpointNotFoundError(f"no committed checkpoint under {storage.root}{not_found_hint(storage)}")
    if ckpt_id is None:
        return _newest(storage, ids)
    if ckpt_id not in ids:
        raise CheckpointNotFoundError(
            f"checkpoint {ckpt_id} is not committed under {storage.root}; committed ids: {_id_list(ids)} "
            "(`cnr inspect` lists them)"
        )
    return ckpt_id


def _id_list(ids: list[int]) -> str:
    return ", ".join(map(str, ids)) if len(ids) <= 12 else f"{ids[0]}..{ids[-1]} ({len(ids)} ids)"
