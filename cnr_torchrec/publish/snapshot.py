"""``cnr publish``: a serving snapshot in a directory, kept current with a root, for servers that reload files.

``DIR/current`` is a symbolic link to the directory of the checkpoint served, ``DIR/v<id>/``, which holds:

- ``model.pt``: ``torch.save`` of ``{name: tensor}`` by the training model's names: each table's weight
  (``table_fqns``) as float32 or float16 rows, or for int8 and int4 uint8 rows in FBGEMM's fused row-wise
  layout (each row its codes, then its fp16 scale and bias:
  ``torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(t, bits)`` reads it back), each row quantized by
  ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` as TorchRec's inference conversion quantizes a table;
  and the dense parameters and buffers as the checkpoint stores them (unquantized), as ``cnr export`` names
  them;
- ``rows.pt`` (int8, int4 and fp16 only; fp32's are ``model.pt``'s): the follower's float32 rows by table,
  which a restarted ``cnr publish`` resumes from;
- ``cursor.json``: the follower's cursor, the dtype, the tables, and each file's xxh3-128.

A new version is written under a temporary name, each file fsynced, renamed into place, and only then does
``current`` change, by replacing the link (one rename); the version before stays for servers still reading
it, older ones are removed. A ``cnr publish`` interrupted anywhere leaves ``current`` at a whole version.
A restart checks the current version's files against its cursor, resumes from it, and applies only what was
committed since; a version whose files do not match is named and reloaded from the root.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from cnr_torchrec.ckpt.format.bytes.storage import fsync_path
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.publish.follower import Cursor, Follower, Update, cursor_of
from cnr_torchrec.publish.targets import FloatSink, FusedSink, Sink

__all__ = ["DTYPES", "Publisher", "SnapshotTarget"]

log = logging.getLogger(__name__)

DTYPES = ("fp32", "fp16", "int8", "int4")
_FLOAT = {"fp32": torch.float32, "fp16": torch.float16}
_BITS = {"int8": 8, "int4": 4}
CURRENT = "current"


class SnapshotTarget:
    """The served tables as ``model.pt`` holds them, in ``dtype``, allocated for the tables the checkpoint holds
    (``tables``, or all)."""

    def __init__(self, dtype: str, tables: Sequence[str] | None = None) -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
        self.dtype, self._only = dtype, None if tables is None else list(tables)
        self.tensors: dict[str, torch.Tensor] = {}
        self.names: dict[str, str] = {}
        self.dense: dict[str, torch.Tensor] = {}

    def sinks(self, tip: Manifest) -> dict[str, Sink]:
        """A sink per table of ``tip`` served (a tensor kept where its shape is unchanged)."""
        out: dict[str, Sink] = {}
        for t in self._only if self._only is not None else sorted(tip.tables):
            if t not in tip.tables:
                continue  # the follower names the missing table
            rows, dim = tip.tables[t]
            self.names[t] = str(tip.table_fqns.get(t, f"{t}.weight"))
            if self.dtype in _FLOAT:
                held = self.tensors.get(t)
                if held is None or tuple(held.shape) != (rows, dim):
                    self.tensors[t] = torch.zeros(rows, dim, dtype=_FLOAT[self.dtype])
                out[t] = FloatSink(self.tensors[t])
            else:
                sink = FusedSink(self.tensors.get(t), rows, dim, _BITS[self.dtype])
                self.tensors[t] = sink.rows
                out[t] = sink
        return out

    def write_dense(self, values: Mapping[str, torch.Tensor]) -> None:
        self.dense = dict(values)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The served tables by their weights' names, and the dense parameters and buffers as stored."""
        return {**self.dense, **{self.names[t]: w for t, w in sorted(self.tensors.items())}}


class Publisher:
    """Keeps the serving snapshot in ``out`` current with ``root``: :meth:`step` applies what was committed
    since the last step (resuming, on the first, from the snapshot ``out`` holds) and writes a new version.

    Raises:
        ConfigError: ``out`` is a file, or holds a snapshot of another root, dtype or set of tables.
    """

    def __init__(self, root: str, out: str, dtype: str = "fp32", tables: Sequence[str] | None = None, *,
                 storage_options: Mapping[str, Any] | None = None, key: Any = None, lease: str | None = None) -> None:
        if os.path.exists(out) and not os.path.isdir(out):
            raise ConfigError(f"--out {out} is a file; give cnr publish a directory (created if missing)")
        os.makedirs(out, exist_ok=True)
        self.out, self.target = os.path.abspath(out), SnapshotTarget(dtype, tables)
        self.follower = Follower(root, self.target, tables=tables, storage_options=storage_options, key=key,
                                 lease=lease)
        for name in os.listdir(self.out):  # what an interrupted publish left
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.out, name), ignore_errors=True)
        saved = _read_current(self.out)
        if saved is not None:
            self._resume(*saved, tables)

    def close(self) -> None:
        self.follower.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resume(self, doc: dict[str, Any], version: str, tables: Sequence[str] | None) -> None:
        dtype = self.target.dtype
        if doc.get("dtype") != dtype or (tables is not None and sorted(doc.get("tables", [])) != sorted(tables)):
            raise ConfigError(f"{self.out} holds a {doc.get('dtype')} snapshot of tables {doc.get('tables')}; give "
                              f"cnr publish the same --dtype and --tables, or another --out")
        cursor = cursor_of(doc["cursor"])
        if cursor.root != self.follower.root:
            raise ConfigError(f"{self.out} holds a snapshot of {cursor.root}, not of {self.follower.root}; give "
                              "cnr publish another --out")
        rows_file = "model.pt" if dtype == "fp32" else "rows.pt"
        for name, digest in doc["files"].items():
            if _digest(os.path.join(version, name)) != digest:
                log.warning("cnr publish: %s in %s does not match its cursor; reloading from the root", name, version)
                return
        rows = torch.load(os.path.join(version, rows_file), weights_only=True)
        if dtype == "fp32":
            by_name = {v: k for k, v in doc["names"].items()}
            rows = {by_name[n]: w for n, w in rows.items() if n in by_name}  # the tables, not the dense state
        self.follower.resume(cursor, rows)

    def step(self) -> list[Update]:
        """Applies every checkpoint committed since the last step and, if any was, writes a new version.
        Raises what :meth:`Follower.poll` raises, after writing the version of the checkpoints it applied before
        the one that failed (none: ``current`` is unchanged)."""
        before = self.follower.cursor
        try:
            updates = self.follower.poll()
        finally:
            cursor = self.follower.cursor
            if cursor is not None and (before is None or cursor.digest != before.digest):
                self._write(cursor)
        return updates

    def _write(self, cursor: Cursor) -> None:
        name = f"v{cursor.ckpt:010d}"
        tmp = os.path.join(self.out, f".tmp-{name}-{os.getpid()}")
        os.makedirs(tmp)
        files = {"model.pt": self.target.state_dict()}
        if self.target.dtype != "fp32":
            files["rows.pt"] = dict(self.follower.served_rows)
        digests = {}
        for file, state in files.items():
            path = os.path.join(tmp, file)
            _save(state, path)
            digests[file] = _digest(path)
        doc = {"cursor": {**cursor.__dict__, "chain": list(cursor.chain)}, "dtype": self.target.dtype,
               "tables": sorted(self.follower.served_rows), "names": self.target.names, "files": digests}
        with open(os.path.join(tmp, "cursor.json"), "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = os.path.join(self.out, name)
        if os.path.exists(final):  # the same checkpoint again (a reload after a failed resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        current = os.path.join(self.out, CURRENT)
        before = os.readlink(current) if os.path.lexists(current) else None
        link = os.path.join(self.out, f".tmp-link-{os.getpid()}")
        os.symlink(name, link)
        os.replace(link, current)
        fsync_path(self.out)
        for old in os.listdir(self.out):  # the version before stays for servers still reading it
            if old.startswith("v") and old[1:].isdigit() and old not in (name, before):
                shutil.rmtree(os.path.join(self.out, old), ignore_errors=True)


def _read_current(out: str) -> tuple[dict[str, Any], str] | None:
    """The current version's cursor document and directory, or None where there is none."""
    link = os.path.join(out, CURRENT)
    if not os.path.lexists(link):
        return None
    version = os.path.join(out, os.readlink(link))
    try:
        with open(os.path.join(version, "cursor.json")) as f:
            doc = json.load(f)
        cursor_of(doc["cursor"])
        if not isinstance(doc["files"], dict) or not isinstance(doc["names"], dict):
            raise TypeError("files and names must be objects")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{link} points at {version}, which holds no snapshot's cursor ({type(e).__name__}: {e}); "
                          "remove it to publish afresh") from None
    return doc, version


def _save(state: Mapping[str, torch.Tensor], path: str) -> None:
    with open(path, "wb") as f:
        torch.save(dict(state), f)
        f.flush()
        os.fsync(f.fileno())


def _digest(path: str) -> str | None:
    h = xxhash.xxh3_128()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()
