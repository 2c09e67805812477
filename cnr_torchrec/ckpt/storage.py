"""Byte storage through torchsnapshot's storage plugins (fs, s3, gs, or a registered one).

The plugins give us reads (whole files or byte ranges), writes and deletes on any
backend. Two things they lack are added here: an atomic, durable write for commit
markers (the fs plugin neither fsyncs nor renames; an object-store PUT is atomic by
itself), and listing, which only the local filesystem offers.
"""

from __future__ import annotations

import asyncio
import io
import os
import posixpath
import shutil
from typing import Any

from torchsnapshot.io_types import ReadIO, WriteIO
from torchsnapshot.storage_plugin import url_to_storage_plugin

from cnr_torchrec.errors import CheckpointNotFoundError, UnsafeCheckpointError

__all__ = ["Storage", "check_relative"]


def check_relative(path: str) -> str:
    """Returns ``path`` if it stays inside the root; raises UnsafeCheckpointError otherwise."""
    norm = posixpath.normpath(path)
    if not path or path.startswith(("/", "\\")) or os.path.isabs(path) or norm == ".." or norm.startswith("../"):
        raise UnsafeCheckpointError(
            f"checkpoint path {path!r} escapes the checkpoint root; refusing to read or write it. "
            "The manifest was edited or corrupted: restore from another checkpoint."
        )
    return norm


class Storage:
    """Reads and writes files under ``root`` (a path or a storage URI). One event loop per instance.

    Not thread-safe: give each thread its own instance.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root
        if "://" in root:
            protocol, path = root.split("://", 1)
            self.local_dir = path if protocol in ("", "fs") else None
        else:
            self.local_dir = root
        self._loop = asyncio.new_event_loop()
        self._plugin = self._run(_make_plugin(root, storage_options or {}))

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    # ------------------------------------------------------------------ files

    def write(self, path: str, data: bytes | memoryview) -> None:
        self._run(self._plugin.write(WriteIO(path=check_relative(path), buf=memoryview(data))))

    def read(self, path: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """Reads a file, or ``[start, end)`` of it. Raises CheckpointNotFoundError if it is missing."""
        rel = check_relative(path)
        read_io = ReadIO(path=rel, byte_range=byte_range)
        try:
            self._run(self._plugin.read(read_io))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self._where(rel)} does not exist") from None
        except Exception as e:  # object stores raise their own "no such key" errors
            if _is_missing(e):
                raise CheckpointNotFoundError(f"{self._where(rel)} does not exist") from None
            raise
        buf = read_io.buf
        return buf.getvalue() if isinstance(buf, io.BytesIO) else bytes(buf)

    def exists(self, path: str) -> bool:
        rel = check_relative(path)
        if self.local_dir is not None:
            return os.path.isfile(os.path.join(self.local_dir, rel))
        try:
            self.read(rel, byte_range=(0, 1))
        except CheckpointNotFoundError:
            return False
        return True

    def delete(self, path: str) -> None:
        """Deletes a file; a file already gone is not an error."""
        rel = check_relative(path)
        try:
            self._run(self._plugin.delete(rel))
        except FileNotFoundError:
            pass
        except Exception as e:
            if not _is_missing(e):
                raise

    def write_atomic(self, path: str, data: bytes) -> None:
        """Writes ``data`` so that readers see either nothing or all of it, durably.

        On a local filesystem: a temporary file, fsync, rename, fsync of the directory.
        Elsewhere a single PUT, which object stores make atomic.
        """
        rel = check_relative(path)
        if self.local_dir is None:
            self.write(rel, data)
            return
        final = os.path.join(self.local_dir, rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fd = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_file(self, path: str) -> None:
        """Flushes a written file to disk (local filesystem only; object stores are durable on PUT)."""
        if self.local_dir is None:
            return
        fd = os.open(os.path.join(self.local_dir, check_relative(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def list_dirs(self) -> list[str] | None:
        """Names of the directories under the root; None where the backend cannot list."""
        if self.local_dir is None:
            return None
        if not os.path.isdir(self.local_dir):
            return []
        return sorted(d for d in os.listdir(self.local_dir) if os.path.isdir(os.path.join(self.local_dir, d)))

    def remove_dir(self, directory: str, files: list[str]) -> None:
        """Deletes ``files`` (paths relative to the root) and, on a filesystem, what is left of ``directory``."""
        for f in files:
            self.delete(f)
        if self.local_dir is not None:
            shutil.rmtree(os.path.join(self.local_dir, check_relative(directory)), ignore_errors=True)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._plugin.close())
            self._loop.close()

    def _where(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"


async def _make_plugin(root: str, options: dict[str, Any]):
    # Plugins may create aiohttp sessions, which need a running loop.
    return url_to_storage_plugin(root, storage_options=options)


def _is_missing(e: Exception) -> bool:
    code = getattr(e, "response", {}).get("Error", {}).get("Code") if hasattr(e, "response") else None
    return code in ("NoSuchKey", "404", "NotFound") or type(e).__name__ in ("NoSuchKey", "NotFound")
