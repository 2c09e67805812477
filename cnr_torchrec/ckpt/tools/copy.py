"""``cnr copy``: committed checkpoints from one root to another (any storage: a directory, ``s3://``), never torn.

Each checkpoint is copied as its bytes, which must pass the checks a restore makes as it reads them: the
manifest's seal (its HMAC on a keyed root), each part's digest and structure, each payload chunk's size and
digest (xxh3, or the keyed BLAKE2b). Between two local roots the kernel copies a chunk and the check is made on
the bytes that landed in the destination (:func:`_copy_chunk`); elsewhere on the source's bytes as they are
read, before they are written. Its payload chunks go first, then its parts, each fsynced as a save makes them,
then its manifest: the commit marker, written atomically, last. So a copy stopped at any point leaves the
destination restorable at the checkpoints whose manifests it wrote, and nothing half-written looks committed.
``index.json`` is written once the checkpoints are. A copy run again skips each checkpoint already committed
there with the same manifest, and each file already there whole (its size and digest checked), so an
interrupted copy resumes.

Checkpoints are copied oldest first, so every delta's parents are committed before it. A destination that
holds another checkpoint under an id being copied is refused.
"""

from __future__ import annotations

import mmap
import posixpath
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from cnr_torchrec.ckpt.format.bytes.integrity import check_chunk
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    committed_ids,
    load_manifest,
    manifest_path,
    part_path,
    walk_chain,
    write_index,
)
from cnr_torchrec.ckpt.format.manifest import Chunk, Manifest
from cnr_torchrec.ckpt.format.schema import part_digest
from cnr_torchrec.ckpt.tools.root import resolve_id
from cnr_torchrec.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["CopyReport", "copy_checkpoints"]

Buffer = bytes | bytearray | mmap.mmap


@dataclass
class CopyReport:
    """What a copy did: the checkpoints ``copied`` and those ``skipped`` (already committed at the destination
    with the same manifest), the files and bytes it wrote, and the files it found already there whole."""

    copied: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    files: int = 0
    nbytes: int = 0
    files_present: int = 0


def copy_checkpoints(src: Storage, dst: Storage, *, everything: bool = False, ckpt: int | None = None,
                     progress: Callable[[int], None] | None = None) -> CopyReport:
    """Copies the chain of ``ckpt`` (default: the newest committed state), or every committed checkpoint with
    ``everything``, from ``src`` to ``dst`` (``cnr copy --compact``, one baseline in place of the chain, is
    :func:`~cnr_torchrec.ckpt.compact.offline.copy_compacted`).

    Args:
        progress: called with the bytes of each file as it is copied.

    Raises:
        CheckpointNotFoundError: nothing committed in ``src``, or ``ckpt`` is not.
        CorruptCheckpointError (UnauthenticatedCheckpointError on a keyed root): a file of ``src`` fails its
            checks; what was copied before it stays committed at ``dst``, the checkpoint it belongs to is not.
        ConfigError: ``dst`` holds another checkpoint under an id being copied.
    """
    if everything:
        ids = committed_ids(src)
        if not ids:
            raise CheckpointNotFoundError(f"no committed checkpoint under {src.root}")
    else:
        tip = load_manifest(src, resolve_id(src, ckpt))
        ids = [m.id for m in walk_chain(tip, lambda i: load_manifest(src, i))]
    report = CopyReport()
    # Each file is flushed to disk by a thread as soon as it is written, while the next is read and checked;
    # a checkpoint's manifest waits for its own files' flushes.
    with ThreadPoolExecutor(4, thread_name_prefix="cnr-copy-sync") as syncs:
        for cid in sorted(ids):
            _copy_one(src, dst, cid, report, progress, syncs)
    write_index(dst, committed_ids(dst))
    return report


def _copy_one(src: Storage, dst: Storage, cid: int, report: CopyReport, progress: Callable[[int], None] | None,
              syncs: ThreadPoolExecutor) -> None:
    manifest = load_manifest(src, cid)  # its seal checked
    raw = bytes(src.read(manifest_path(cid)))
    if dst.exists(manifest_path(cid)):
        if bytes(dst.read(manifest_path(cid))) == raw:
            report.skipped.append(cid)
            return
        raise ConfigError(f"{dst.root} holds another checkpoint {cid} than {src.root} does; copy into an empty root, "
                          "or into an earlier copy of this one")
    written: list[Future[None]] = []
    chunks = _chunks(manifest)
    parts = [part_path(cid, r) for r in range(len(manifest.summaries))] if manifest.version >= 7 else []
    for chunk in chunks:
        _copy_chunk(src, dst, chunk, report, progress, written, syncs)
    for r, path in enumerate(parts):
        data = src.read(path)
        digest, keyed = part_digest(manifest.body["parts"][r])
        check_chunk(src.key, path, data, manifest.body["parts"][r]["nbytes"], digest, keyed)
        if not _present(dst, path, len(data), lambda there: bytes(there) == bytes(data), report):
            _written(dst, path, memoryview(data), len(data), report, progress, written, syncs)
    for synced in written:  # every file durable before the manifest that commits it, as a save makes its files
        synced.result()
    for directory in sorted({posixpath.dirname(p) for p in [c.path for c in chunks] + parts} - {""}):
        dst.fsync_file(directory)  # and the directories that name them
    dst.write_atomic(manifest_path(cid), raw)  # the commit, last
    report.copied.append(cid)
    report.files += 1
    report.nbytes += len(raw)


def _chunks(manifest: Manifest) -> list[Chunk]:
    """Every payload chunk of every rank (reading each part, which checks it)."""
    try:
        return [c for report in manifest.ranks for c in report.payload.chunks]
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"checkpoint {manifest.id}: {e}") from None


def _copy_chunk(src: Storage, dst: Storage, chunk: Chunk, report: CopyReport,
                progress: Callable[[int], None] | None, written: list[Future[None]], syncs: ThreadPoolExecutor) -> None:
    """Copies one payload chunk, checked, unless ``dst`` holds it whole already (an interrupted copy's).

    Between two local roots the kernel copies it (:meth:`Storage.write` of a
    :class:`~cnr_torchrec.ckpt.format.bytes.storage.LocalFile`), and what is checked is the copy: the bytes that
    landed in ``dst``, as its page cache holds them, against the chunk's size and digest. That vouches for the
    source and for the copy at once, whatever the source's file did meanwhile. Elsewhere the source's bytes are
    checked as they are read, then written.
    """
    source = src.local_file(chunk.path) if dst.local_dir is not None else None
    if source is None:
        data = src.read_mapped(chunk.path)  # a local file's pages, checked and written with no copy of its own
        check_chunk(src.key, chunk.path, data, chunk.nbytes, chunk.digest, chunk.keyed)
        if not _present(dst, chunk.path, len(data), lambda there: _matches(src, chunk, there), report):
            _written(dst, chunk.path, memoryview(data), len(data), report, progress, written, syncs)
        return
    if _present(dst, chunk.path, source.nbytes, lambda there: _matches(src, chunk, there), report):
        return
    dst.write(chunk.path, source)
    landed = dst.read_mapped(chunk.path)
    if not _matches(src, chunk, landed):
        dst.delete(chunk.path)  # nothing unchecked stays behind
        check_chunk(src.key, chunk.path, src.read_mapped(chunk.path), chunk.nbytes, chunk.digest, chunk.keyed)
        raise CorruptCheckpointError(
            f"the copy of {chunk.path} at {dst.root} does not match its digest, though {src.root}'s does: the "
            "destination lost or changed bytes as they were written. Check its disk, then run cnr copy again",
            path=chunk.path)
    _written(dst, chunk.path, None, source.nbytes, report, progress, written, syncs)


def _written(dst: Storage, path: str, data: memoryview | None, nbytes: int, report: CopyReport,
             progress: Callable[[int], None] | None, written: list[Future[None]], syncs: ThreadPoolExecutor) -> None:
    """Writes ``data`` to ``path`` (None: it is there already) and has ``syncs`` flush it, its future added to
    ``written``."""
    if data is not None:
        dst.write(path, data)
    written.append(syncs.submit(dst.fsync_file, path))
    report.files += 1
    report.nbytes += nbytes
    if progress is not None:
        progress(nbytes)


def _present(dst: Storage, path: str, nbytes: int, whole: Callable[[Buffer], bool], report: CopyReport) -> bool:
    """Whether ``dst`` holds ``path`` of ``nbytes`` bytes already and ``whole`` passes on its bytes (counted in
    ``report``): an interrupted copy's file, which is then not written again."""
    if _size(dst, path) not in (nbytes, None):
        return False
    try:
        there = dst.read_mapped(path)
    except CheckpointNotFoundError:
        return False
    if not whole(there):
        return False
    report.files_present += 1
    return True


def _matches(src: Storage, chunk: Chunk, data: Buffer) -> bool:
    try:
        check_chunk(src.key, chunk.path, data, chunk.nbytes, chunk.digest, chunk.keyed)
    except (CorruptCheckpointError, UnsafeCheckpointError):
        return False  # not whole: written again
    return True


def _size(dst: Storage, path: str) -> int | None:
    """The file's size, -1 where it is not there, None where the store cannot tell without reading it."""
    try:
        return dst.size(path)
    except CheckpointNotFoundError:
        return -1
