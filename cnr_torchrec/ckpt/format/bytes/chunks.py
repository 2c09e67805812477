"""A rank's payload as chunks: objects of at most ``chunk_bytes``, streamed out and read back in parallel.

The payload is one logical byte stream: blobs back to back, each at a 64-byte aligned
offset (:class:`~cnr_torchrec.ckpt.format.bytes.payload.BlobWriter`). It is cut at every
multiple of ``chunk_bytes`` into chunk objects, so no object outgrows the stride (S3
refuses a single PUT above 5 GB), and a blob may span several chunks. The rank report
describes them::

    "file": "ckpt-00000007/rank-00001.bin",   # chunk 0; chunk k is rank-00001.<k>.bin
    "nbytes": 150000000,                       # the whole payload
    "chunk_bytes": 67108864,
    "chunks": [{"nbytes": 67108864, "xxh3": "..."}, {"nbytes": 67108864, ...}, {"nbytes": 15782272, ...}]

On a root with a key a chunk is listed with ``blake2b``, a keyed digest, in place of ``xxh3``
(:mod:`~cnr_torchrec.ckpt.format.bytes.integrity`). A report without ``chunks`` (format 3 and older) is
one chunk: ``file``, ``nbytes``, ``xxh3``.

Writing (:class:`PayloadWriter`) pipelines encoding with I/O: the caller adds blobs, and
each chunk that fills goes to an :class:`IOPool` thread while the next is encoded; at
most ``in_flight`` chunks wait, so the writer holds no more than a few chunks beyond the
tensors it was given. Local chunks are written from the blobs' own memory (no join).
Reading (:class:`PayloadReader`) starts every chunk's read at once and hands out blobs as
their chunks land, each chunk checked against its digest first.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from cnr_torchrec.ckpt.format.bytes.integrity import RootKey, check_chunk, chunk_hasher, chunk_record
from cnr_torchrec.ckpt.format.bytes.payload import BlobWriter, read_blob
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Chunk, Payload, chunk_path
from cnr_torchrec.errors import CorruptCheckpointError

__all__ = ["DEFAULT_CHUNK_BYTES", "IOPool", "PayloadReader", "PayloadWriter", "covering", "landed", "read_range"]

# One sweep of benchmarks/scale.py at 10x (docs/scale.md), 4 to 256 MiB: baseline writes showed no trend,
# restores got faster with bigger chunks and peak memory grew; 64 MiB sits between. An object store
# holds up to io_threads + 1 joined chunks in memory while they upload.
DEFAULT_CHUNK_BYTES = 64 << 20


class IOPool:
    """Threads for chunk reads and writes, each with its own :class:`Storage` on one root.

    Storage is not thread-safe (one event loop, one S3 client each), so every worker opens
    its own on first use. Several threads share the pool (the save, compaction and restore
    paths of one Checkpointer); :meth:`close` closes every storage it opened.
    """

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None, threads: int,
                 key: RootKey | None = None) -> None:
        self.root, self.threads, self.key = root, threads, key
        self._options = dict(storage_options or {})
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cnr-io")
        self._local = threading.local()
        self._opened: list[Storage] = []
        self._lock = threading.Lock()

    def open_storage(self) -> Storage:
        """A new Storage on the pool's root, with its key: for a thread of the caller's (the caller closes it)."""
        return Storage(self.root, self._options, key=self.key)

    def _storage(self) -> Storage:
        storage = getattr(self._local, "storage", None)
        if storage is None:
            storage = self._local.storage = self.open_storage()
            with self._lock:
                self._opened.append(storage)
        return storage

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Runs ``fn(storage, *args)`` on a pool thread."""
        return self._pool.submit(lambda: fn(self._storage(), *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            opened, self._opened = self._opened, []
        for storage in opened:
            storage.close()


def _write_chunk(storage: Storage, path: str, parts: Sequence[memoryview]) -> dict[str, Any]:
    """Writes one chunk durably; returns its entry in the report: its size and digest (xxh3, or keyed BLAKE2b
    on a root with a key)."""
    digest = chunk_hasher(storage.key)
    for part in parts:
        digest.update(part)
    storage.write(path, parts)
    storage.fsync_file(path)
    return chunk_record(storage.key, sum(p.nbytes for p in parts), digest.hexdigest())


class PayloadWriter(BlobWriter):
    """A :class:`BlobWriter` that streams its payload out as chunks while blobs are still being added.

    Args:
        storage: where to write when ``pool`` is None (chunks are then written in the caller's thread).
        file: chunk 0's path (:func:`~cnr_torchrec.ckpt.format.commits.rank_file`).
        chunk_bytes: the stride; a multiple of :attr:`BlobWriter.ALIGN`.
        pool: threads to write on; None writes synchronously.
        in_flight: chunks handed to the pool and not yet written, at most, before :meth:`add` blocks
            (default: the pool's threads plus one, so one waits while every thread writes).
    """

    def __init__(self, storage: Storage | None, file: str, chunk_bytes: int, pool: IOPool | None = None,
                 in_flight: int | None = None) -> None:
        super().__init__()
        if chunk_bytes <= 0 or chunk_bytes % self.ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {self.ALIGN}, got {chunk_bytes}")
        self.file, self.chunk_bytes = file, chunk_bytes
        self._storage, self._pool = storage, pool
        self._current: list[memoryview] = []
        self._filled = 0
        self._done: list[Future] = []
        self._slots = threading.Semaphore(in_flight or (pool.threads + 1 if pool else 1))

    def _append(self, data: memoryview) -> None:
        while data.nbytes:
            take = data[: self.chunk_bytes - self._filled]
            self._current.append(take)
            self._filled += take.nbytes
            data = data[take.nbytes :]
            if self._filled == self.chunk_bytes:
                self._flush()

    def _flush(self) -> None:
        path, parts = chunk_path(self.file, len(self._done)), self._current
        self._current, self._filled = [], 0
        if self._pool is None:
            future: Future = Future()
            assert self._storage is not None  # a writer without a pool writes through its own storage
            future.set_result(_write_chunk(self._storage, path, parts))
        else:
            self._slots.acquire()  # back-pressure: encoding waits while enough chunks are queued
            future = self._pool.submit(_write_chunk, path, parts)
            future.add_done_callback(lambda _: self._slots.release())
        self._done.append(future)

    def finish(self) -> dict[str, Any]:
        """Writes the last chunk and waits for every chunk. Returns the report's payload keys.

        Raises:
            Exception: the first chunk write that failed (the rest were waited for or cancelled).
        """
        if self._filled or not self._done:
            self._flush()  # the tail; an empty payload is one empty chunk
        chunks = []
        try:
            for future in self._done:
                chunks.append(future.result())
        except BaseException:
            for future in self._done:
                future.cancel()
            for future in self._done:
                if not future.cancelled():
                    future.exception()  # let the running ones end before the caller removes the files
            raise
        return {"file": self.file, "nbytes": self.nbytes, "chunk_bytes": self.chunk_bytes, "chunks": chunks,
                "blobs": self.index}

    def getvalue(self) -> bytes:
        raise TypeError("a PayloadWriter streams its payload; call finish()")


def covering(chunks: Sequence[Chunk], start: int, end: int) -> list[int]:
    """The indices of the chunks that hold bytes of ``[start, end)`` of their payload."""
    return [k for k, c in enumerate(chunks) if c.start < end and start < c.end] if end > start else []


def read_range(storage: Storage, chunks: Sequence[Chunk], start: int, end: int) -> bytearray:
    """Bytes ``[start, end)`` of a payload, by range reads of the chunks that hold them (writable, so that
    tensors can view them)."""
    pieces = [storage.read(chunks[k].path, byte_range=(max(start, chunks[k].start) - chunks[k].start,
                                                       min(end, chunks[k].end) - chunks[k].start))
              for k in covering(chunks, start, end)]
    if len(pieces) == 1 and isinstance(pieces[0], bytearray):
        return pieces[0]
    return bytearray(b"".join(pieces))


def landed(future: Future, stats: dict[str, float] | None) -> Any:
    """``future``'s result; the time spent waiting for it is added to ``stats["read_wait_ms"]``."""
    if future.done() or stats is None:
        return future.result()
    t0 = time.perf_counter()
    try:
        return future.result()
    finally:
        stats["read_wait_ms"] = stats.get("read_wait_ms", 0.0) + (time.perf_counter() - t0) * 1e3


def _read_chunk(storage: Storage, chunk: Chunk) -> bytearray | mmap.mmap:
    """A chunk's bytes, checked against its size and digest (writable, so that tensors can view them).

    A local chunk is mapped, unless the root has a key: then it is read into memory first, so that the
    bytes checked are the bytes used."""
    data = storage.read_mapped(chunk.path) if storage.key is None else bytearray(storage.read(chunk.path))
    check_chunk(storage.key, chunk.path, data, chunk.nbytes, chunk.digest, chunk.keyed)
    return data


class PayloadReader:
    """The blobs of one rank's payload: ``reader(name)`` is the stored tensor.

    Args:
        storage: the caller's storage (reads on the caller's thread when ``pool`` is None).
        payload: the payload (a :class:`~cnr_torchrec.ckpt.format.manifest.RankReport`'s ``payload``).
        stats: counts ``bytes_read`` and ``reads`` into this dict, and ``read_wait_ms``: the time spent
            waiting for chunks that had not landed yet.
        whole: read every chunk (at once, in parallel on ``pool``) and view blobs in place;
            False: one range read per blob, for a few small blobs of a big payload (not on a root with a
            key: only a whole chunk's keyed digest vouches for its bytes).
        pool: threads for the chunk reads.
    """

    def __init__(self, storage: Storage, payload: Payload, stats: dict[str, float] | None = None,
                 whole: bool = True, pool: IOPool | None = None) -> None:
        self.storage, self.payload = storage, payload
        self.chunks = payload.chunks
        self._stats, self._whole, self._pool = stats, whole or storage.key is not None, pool
        self._data: list[Future] | None = None

    def __call__(self, name: str) -> torch.Tensor:
        file = self.payload.file
        try:
            blob = self.payload.blobs[name]
        except KeyError:
            raise CorruptCheckpointError(f"{file}: the manifest names blob {name!r} but does not describe it",
                                         file) from None
        if not self._whole:
            self._count(blob.nbytes, 1)
            return read_blob(file, blob, name, self._range(blob.offset, blob.end))
        self.start()
        # The chunk's digest vouches for the chunk, not for where in it the blob's offset points: its own xxh3 does.
        return read_blob(file, blob, name, self._view(blob.offset, blob.end))

    def start(self) -> None:
        """Starts reading every chunk (once), so that the reads overlap whatever the caller does next."""
        if self._data is not None:
            return
        self._data = []
        for chunk in self.chunks:
            if self._pool is None:
                future: Future = Future()
                future.set_result(_read_chunk(self.storage, chunk))
            else:
                future = self._pool.submit(_read_chunk, chunk)
            self._data.append(future)
        self._count(sum(c.nbytes for c in self.chunks), len(self.chunks))

    def _covering(self, start: int, end: int) -> list[int]:
        return covering(self.chunks, start, end)

    def _view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)``: a view into one chunk's buffer, or a copy joined from several."""
        pieces = []
        for k in self._covering(start, end):
            c = self.chunks[k]
            buf = memoryview(self._landed(k))
            pieces.append(buf[max(start, c.start) - c.start : min(end, c.end) - c.start])
        if len(pieces) == 1:
            return pieces[0]
        return memoryview(bytearray(b"".join(pieces)))  # short if chunks are missing: read_blob names it

    def _landed(self, k: int) -> bytearray | mmap.mmap:
        """Chunk ``k``'s bytes, once read and checked (waiting counts as ``read_wait_ms``)."""
        assert self._data is not None  # start() ran: every caller reads through it
        return landed(self._data[k], self._stats)

    def _range(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` by range reads of the chunks that hold them."""
        return read_range(self.storage, self.chunks, start, end)

    def _count(self, nbytes: int, reads: int) -> None:
        if self._stats is not None:
            self._stats["bytes_read"] = self._stats.get("bytes_read", 0) + nbytes
            self._stats["reads"] = self._stats.get("reads", 0) + reads
