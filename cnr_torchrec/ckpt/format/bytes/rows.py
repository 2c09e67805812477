"""Some rows of a stored entry, read by byte range and checked by groups of rows (format 5).

Every blob of an entry's rows holds one record per stored row: the codec's tensors, the
optimizer states. Since format 5 an entry also stores ``checks``: one CRC-32C for each group
of ``rows`` consecutive stored rows, over the group's bytes in each of those blobs in turn
(:attr:`~cnr_torchrec.ckpt.format.manifest.TableEntry.row_blobs` gives the order;
``torch.ops.cnr.row_crc32c`` computes them). A group holds about
:data:`CHECK_BYTES` of rows. A reader that needs some rows of an entry fetches only the
groups that hold them and checks every byte it uses.

Why groups of rows and not single rows: a 4-byte CRC per row costs 18% of a 4-bit delta of
32-wide rows (22 bytes a row), while the storage reads whole pages anyway (the kernel reads
4 KiB under a mapped row; S3 GETs are joined across gaps far wider than a row). One CRC per
512 bytes costs 0.8%.

How the ranges are fetched depends on the storage:

- a local file is mapped (``Storage.read_mapped``): the groups are hashed where they lie
  (a group cut by a chunk's end is copied out first) and only the rows asked for are
  copied out, so the kernel reads the pages under those groups and nothing else; the
  ranges are announced first (``madvise(MADV_WILLNEED)``), so that a cold read proceeds
  while earlier entries decode. ``bytes_read`` counts the groups' bytes.
- an object store gets one GET per run of needed groups, neighbouring runs joined when the
  gap between them is under :data:`REMOTE_GAP_BYTES`, issued on the I/O threads as soon as
  the entry is planned. ``bytes_read`` counts the bytes of those GETs.

An entry of format 4 or older has no checks: its blobs are read whole, through their chunks
(:class:`~cnr_torchrec.ckpt.format.bytes.chunks.PayloadReader`), as before. So is every entry on a root
with a key (:mod:`~cnr_torchrec.ckpt.format.bytes.integrity`): a CRC-32C can be forged by whoever can
write the file, and only a whole chunk's keyed digest vouches for its bytes.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from cnr_torchrec.ckpt.format.bytes.chunks import IOPool, PayloadReader, covering, landed, read_range
from cnr_torchrec.ckpt.format.bytes.payload import DTYPES, BlobWriter, read_blob
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Blob, Chunk, Payload, TableEntry
from cnr_torchrec.ckpt.format.writing import row_keys
from cnr_torchrec.errors import CorruptCheckpointError
from cnr_torchrec.ops import row_crc32c
from cnr_torchrec.quant import EncodedRows

__all__ = ["CHECK_BYTES", "REMOTE_GAP_BYTES", "RowReader", "as_rows", "write_rows"]

# The stored bytes one CRC-32C covers, about (a disk sector): a group holds as many whole rows.
CHECK_BYTES = 512
# An S3 GET pays a round trip (tens of ms) before its first byte: reading through a gap this size
# costs less than a second request.
REMOTE_GAP_BYTES = 256 << 10
_PAGE = mmap.PAGESIZE


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as uint8 ``[rows, bytes a row]`` (``t`` holds one record per row along dim 0)."""
    t = t.detach().contiguous()
    width = math.prod(t.shape[1:]) * t.element_size()
    return t.view(torch.uint8).reshape(t.shape[0], width) if t.numel() else torch.empty(t.shape[0], width,
                                                                                         dtype=torch.uint8)


def write_rows(blobs: BlobWriter, prefix: str, encoded: EncodedRows,
               states: Sequence[tuple[torch.Tensor, bool]],
               mc: tuple[torch.Tensor, Sequence[str]] | None = None) -> dict[str, Any]:
    """Adds an entry's row blobs (encoded rows, optimizer states as given, the managed-collision state
    ``(int64 rows, fields)`` of a sort-zch table) and the CRC-32Cs of their groups of rows to ``blobs``.
    Returns the entry's ``weights``, ``states``, ``checks`` (and ``mc``) keys."""
    tensors = encoded.to_tensors()
    names = {k: blobs.add(f"{prefix}/w/{k}", v) for k, v in tensors.items()}
    refs = [(rowwise, blobs.add(f"{prefix}/state{j}", t)) for j, (t, rowwise) in enumerate(states)]
    parts = [as_rows(tensors[k]) for k in sorted(tensors)] + [as_rows(t) for t, _ in states]
    mc_ref = None
    if mc is not None:
        mc_ref = (blobs.add(f"{prefix}/mc", mc[0]), list(mc[1]))
        parts.append(as_rows(mc[0]))
    rows = max(1, CHECK_BYTES // max(1, sum(p.shape[1] for p in parts)))
    checks = (blobs.add(f"{prefix}/crc32c", row_crc32c(parts, rows)), rows)
    return row_keys(encoded.metadata(), names, refs, checks, mc_ref)


class _Fetch:
    """The pending reads of one entry's needed rows: the check groups that hold them, and per blob the spans
    that hold those groups."""

    def __init__(self, sel: np.ndarray, size: int, n: int) -> None:
        self.sel, self.size, self.n = sel, size, n  # the rows asked for; rows a group; rows of the entry
        if size == 1:
            self.groups = sel
        elif sel.size == n:  # every row (sorted and distinct): every group
            self.groups = np.arange(-(-n // size), dtype=np.int64)
        else:
            of = sel // size  # sorted, so the distinct groups are where it changes
            first = np.empty(of.size, dtype=bool)
            first[:1] = True
            np.not_equal(of[1:], of[:-1], out=first[1:])
            self.groups = of[first]
        self.spans: dict[str, list[tuple[int, int, Any]]] = {}  # blob -> [(first, end, bytes or their Future)]

    @property
    def full(self) -> np.ndarray:
        """Every row of the groups, in order."""
        return self.sel if self.size == 1 else _rows_of_groups(self.groups, self.size, self.n)


class RowReader:
    """Reads one rank's payload: whole blobs by name, and chosen rows of its entries.

    Args:
        storage: the caller's storage (maps local chunks; reads elsewhere when ``pool`` is None).
        payload: the rank report's payload.
        stats: gets ``bytes_read``, ``reads`` and ``read_wait_ms``.
        pool: I/O threads for the GETs of an object store.
    """

    def __init__(self, storage: Storage, payload: Payload, stats: dict[str, float] | None = None,
                 pool: IOPool | None = None) -> None:
        self.storage, self.payload, self._stats, self._pool = storage, payload, stats, pool
        self._mapped = storage.local_dir is not None
        self._maps: dict[int, Any] = {}
        # Entries without CRCs, and every read on a root with a key (whose range reads nothing vouches for):
        # the payload's chunks, read whole.
        self._whole: PayloadReader | None = None
        self._keyed = storage.key is not None
        self._blobs = PayloadReader(storage, payload, stats, whole=False)
        self._pending: dict[int, _Fetch] = {}
        self._checked: dict[int, _Fetch | list[torch.Tensor]] = {}  # by entry: rows check() read and checked
        self._blob_reads: dict[str, Future] = {}

    # ------------------------------------------------------------------ whole blobs

    def __call__(self, name: str) -> torch.Tensor:
        """Blob ``name``, checked against its xxh3 (a range read; from the chunks if they are read whole)."""
        if self._whole is not None or self._keyed:
            self._start_whole()
            assert self._whole is not None
            return self._whole(name)
        future = self._blob_reads.pop(name, None)
        if future is not None:
            return read_blob(self.payload.file, self.payload.blobs[name], name, self._landed(future))
        blob = self.payload.blobs.get(name)
        if not self._mapped or blob is None:
            return self._blobs(name)  # a range read (which names a blob the manifest does not describe)
        self._count(blob.nbytes, 0)
        return read_blob(self.payload.file, blob, name, self._mapped_bytes(blob.offset, blob.end))

    def _mapped_bytes(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the payload from the mapped chunks (short where a chunk is)."""
        pieces = []
        for k in self._covering(start, end):
            c, mm = self.payload.chunks[k], self._map(k)
            pieces.append(memoryview(mm)[max(start, c.start) - c.start : min(end, c.end) - c.start])
        if len(pieces) == 1:
            return pieces[0]
        return memoryview(bytearray(b"".join(pieces)))

    def fetch_blobs(self, names: Sequence[str]) -> None:
        """Starts range reads of blobs ``names`` on the I/O threads (an object store's round trips overlap);
        ``reader(name)`` then takes each. A local file is read when asked."""
        if self._pool is None or self._mapped or self._keyed:
            return
        for name in names:
            blob = self.payload.blobs.get(name)
            if blob is not None and name not in self._blob_reads:
                self._blob_reads[name] = self._pool.submit(self._get, blob.offset, blob.end)
                self._count(blob.nbytes, len(self._covering(blob.offset, blob.end)))

    # ------------------------------------------------------------------ rows

    def prefetch(self, entry: TableEntry, sel: torch.Tensor) -> None:
        """Starts reading rows ``sel`` (sorted stored positions) of ``entry``; :meth:`rows` gets them. (An entry
        without CRCs starts the read of every chunk of the payload, as restores of format 4 did.)"""
        if not self._by_groups(entry):
            self._start_whole()
            return
        fetch = _Fetch(sel.numpy(), entry.row_checks.rows, entry.num_stored)
        for name in entry.row_blobs:
            fetch.spans[name] = self._spans(self.payload.blobs[name], fetch.groups, fetch.size)
        fetch.spans[entry.row_checks.blob] = self._spans(self.payload.blobs[entry.row_checks.blob], fetch.groups, 1)
        self._pending[id(entry)] = fetch

    def rows(self, entry: TableEntry, sel: torch.Tensor,
             into: Mapping[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The rows ``sel`` (sorted stored positions) of each of ``entry``'s :attr:`~TableEntry.row_blobs`,
        their groups checked against the entry's CRCs (without them: the whole blobs, checked against their
        xxh3), or as :meth:`check` checked them already.

        Args:
            into: per blob name, a uint8 ``[rows, the blob's bytes a row]`` tensor the blob's rows are copied into
                (and returned as, typed), instead of memory of their own.
        """
        checked = self._checked.pop(id(entry), None)
        if isinstance(checked, _Fetch):  # checked where they lie: copied out now
            parts = [self._gather(name, checked, checked.sel, (into or {}).get(name))
                     for name in entry.row_blobs]
            return [self._typed(name, p) for name, p in zip(entry.row_blobs, parts)]
        parts = checked if checked is not None else self._read_rows(entry, sel)
        for name, out in (into or {}).items():
            k = entry.row_blobs.index(name)
            out.copy_(parts[k].reshape(parts[k].shape[0], -1).view(torch.uint8))
            parts[k] = self._typed(name, out)
        return parts

    def check(self, entry: TableEntry, sel: torch.Tensor) -> list[torch.Tensor]:
        """Reads the rows ``sel`` of ``entry`` and checks them as :meth:`rows` does, for :meth:`rows` to give next:
        on a local root, checked where they lie in the mapped files and not yet copied (returned as tensors on
        the meta device, of the shapes and dtypes :meth:`rows` will give); elsewhere read and kept.

        Raises:
            CorruptCheckpointError: as :meth:`rows`.
        """
        if not (self._mapped and self._by_groups(entry)):
            parts = self._checked[id(entry)] = self._read_rows(entry, sel)
            return parts
        fetch = self._fetch(entry, sel)
        got = self._crc_in_place(entry, fetch)
        self._check_groups(entry, fetch, got)
        self._checked[id(entry)] = fetch
        blobs = [self.payload.blobs[name] for name in entry.row_blobs]
        return [torch.empty((fetch.sel.size, *b.shape[1:]), dtype=DTYPES[b.dtype], device="meta") for b in blobs]

    def _read_rows(self, entry: TableEntry, sel: torch.Tensor) -> list[torch.Tensor]:
        if not self._by_groups(entry):  # whole blobs, each checked against its xxh3 (or its chunk's digest)
            return [self(name).index_select(0, sel) for name in entry.row_blobs]
        fetch = self._fetch(entry, sel)
        size = entry.row_checks.rows
        if self._mapped:  # hash the groups where they lie, copy out the asked-for rows only
            got = self._crc_in_place(entry, fetch)
            self._check_groups(entry, fetch, got)
            parts = [self._gather(name, fetch, fetch.sel) for name in entry.row_blobs]
        else:  # copy out the groups, hash them, keep the asked-for rows
            full = fetch.full
            parts = [self._gather(name, fetch, full) for name in entry.row_blobs]
            self._check_groups(entry, fetch, row_crc32c(parts, size))
            if full.size != fetch.sel.size:
                keep = torch.from_numpy(np.searchsorted(full, fetch.sel))
                parts = [p.index_select(0, keep) for p in parts]
        return [self._typed(name, p) for name, p in zip(entry.row_blobs, parts)]

    def _fetch(self, entry: TableEntry, sel: torch.Tensor) -> _Fetch:
        """The reads of rows ``sel`` of ``entry``: those :meth:`prefetch` started, or started now."""
        fetch = self._pending.pop(id(entry), None)
        if fetch is None:
            self.prefetch(entry, sel)
            fetch = self._pending.pop(id(entry))
        return fetch

    def _check_groups(self, entry: TableEntry, fetch: _Fetch, got: torch.Tensor) -> None:
        want = self._gather(entry.row_checks.blob, fetch, fetch.groups).view(torch.int32).reshape(-1)
        bad = np.flatnonzero((got != want).numpy())
        if bad.size:
            self._corrupt(entry, int(fetch.groups[bad[0]]) * entry.row_checks.rows, bad.size)

    def _crc_in_place(self, entry: TableEntry, fetch: _Fetch) -> torch.Tensor:
        """The CRCs of ``fetch.groups``, hashed in the mapped chunks; a group cut by a chunk's end (in any of
        the entry's blobs) is copied out first."""
        names, size, n, groups = entry.row_blobs, entry.row_checks.rows, entry.num_stored, fetch.groups
        # Between two cuts, each blob's rows lie in one span.
        cuts = sorted({0, n, *(r for name in names for span in fetch.spans[name] for r in span[:2])})
        got = torch.empty(groups.size, dtype=torch.int32)
        done = np.zeros(groups.size, dtype=bool)
        for a, b in zip(cuts[:-1], cuts[1:]):
            g0, g1 = -(-a // size), (b // size if b < n else -(-n // size))  # the groups whole in [a, b)
            i, j = (int(x) for x in np.searchsorted(groups, [g0, g1]))
            if j <= i:
                continue
            lo, hi = g0 * size, min(n, g1 * size)
            views = [self._rows_view(name, fetch, lo, hi) for name in names]
            got[i:j] = row_crc32c(views, size, torch.from_numpy(groups[i:j] - g0))
            done[i:j] = True
        rest = np.flatnonzero(~done)
        if rest.size:
            rows = _rows_of_groups(groups[rest], size, n)
            got[torch.from_numpy(rest)] = row_crc32c([self._gather(name, fetch, rows) for name in names], size)
        return got

    def _rows_view(self, name: str, fetch: _Fetch, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of blob ``name`` as a uint8 ``[rows, width]`` view of the one span that holds them."""
        blob = self.payload.blobs[name]
        width = blob.nbytes // blob.shape[0]
        r0, r1, buf = next(span for span in fetch.spans[name] if span[0] <= lo and hi <= span[1])
        return self._span(name, r0, r1, buf, width, torch.uint8).view(r1 - r0, width)[lo - r0 : hi - r0]

    def _span(self, name: str, r0: int, r1: int, buf: Any, width: int, word: torch.dtype) -> torch.Tensor:
        """The bytes of rows ``[r0, r1)`` of blob ``name`` (``width`` bytes a row) as a flat tensor of ``word``,
        once checked to be all there."""
        if len(buf) != (r1 - r0) * width:
            raise CorruptCheckpointError(f"{self.payload.file} is truncated: rows [{r0}, {r1}) of blob {name} "
                                         f"need {(r1 - r0) * width} bytes, got {len(buf)}", path=self.payload.file)
        return torch.frombuffer(buf, dtype=word)

    def _typed(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        blob = self.payload.blobs[name]
        return rows.view(DTYPES[blob.dtype]).reshape(rows.shape[0], *blob.shape[1:])

    def _corrupt(self, entry: TableEntry, position: int, count: int) -> None:
        files = []  # the chunks that hold the group's first row, in the order its CRC covers them
        group = position // entry.row_checks.rows
        for name, at in [*((n, position) for n in entry.row_blobs), (entry.row_checks.blob, group)]:
            blob = self.payload.blobs[name]
            path = chunk_of(self.payload, blob.offset + at * (blob.nbytes // blob.shape[0])).path
            if path not in files:
                files.append(path)
        more = f" (its bytes are in {', '.join(files)})" if len(files) > 1 else ""
        last = min(entry.num_stored, position + entry.row_checks.rows) - 1
        raise CorruptCheckpointError(
            f"{files[0]}: stored rows {position} to {last} of the entry for rows [{entry.rows[0]}, {entry.rows[1]}) "
            f"do not match their CRC-32C in the file ({count} of the groups read do not){more}; the file is damaged",
            path=files[0])

    def _by_groups(self, entry: TableEntry) -> bool:
        """Whether ``entry``'s rows are read by their CRC groups (format 5, on a root without a key)."""
        return entry.checks is not None and not self._keyed

    def _start_whole(self) -> None:
        if self._whole is None:
            self._whole = PayloadReader(self.storage, self.payload, self._stats, pool=self._pool)
        self._whole.start()

    # ------------------------------------------------------------------ byte ranges

    def _spans(self, blob: Blob, groups: np.ndarray, size: int) -> list[tuple[int, int, Any]]:
        """Row spans of ``blob`` that cover groups ``groups`` of ``size`` rows (sorted), each with its bytes (or
        a Future of them)."""
        n = blob.shape[0] if blob.shape else 0
        if not groups.size or not blob.nbytes:
            return []
        width = blob.nbytes // n
        if self._mapped:
            return self._mapped_spans(blob, width, groups, size)
        gap = REMOTE_GAP_BYTES // (width * size)  # in groups
        cut = np.flatnonzero(np.diff(groups) > gap + 1)
        firsts = groups[np.concatenate(([0], cut + 1))] * size
        ends = np.minimum((groups[np.concatenate((cut, [groups.size - 1]))] + 1) * size, n)
        spans = []
        for r0, r1 in zip(firsts.tolist(), ends.tolist()):
            start, end = blob.offset + r0 * width, blob.offset + r1 * width
            if self._pool is None:
                data: Any = self._get(self.storage, start, end)
            else:
                data = self._pool.submit(self._get, start, end)
            spans.append((r0, r1, data))
            self._count(end - start, len(self._covering(start, end)))
        return spans

    def _mapped_spans(self, blob: Blob, width: int, groups: np.ndarray, size: int) -> list[tuple[int, int, Any]]:
        """Views of the mapped chunks, one per chunk the blob's rows lie in whole (a row cut by a chunk's
        end is joined, alone), after telling the kernel which pages of the groups will be read."""
        spans: list[tuple[int, int, Any]] = []
        n = blob.nbytes // width
        starts = groups * size
        ends = np.minimum(starts + size, n)
        for k in self._covering(blob.offset, blob.end):
            c = self.payload.chunks[k]
            r0 = max(0, -(-(c.start - blob.offset) // width))  # first row that starts in the chunk
            r1 = min(n, (c.end - blob.offset) // width)  # past the last row that ends in it
            if blob.offset < c.start < blob.offset + r0 * width:  # row r0 - 1 straddles the chunk's start
                i = int(np.searchsorted(ends, r0 - 1, side="right"))
                if i < groups.size and starts[i] <= r0 - 1:
                    start = blob.offset + (r0 - 1) * width
                    spans.append((r0 - 1, r0, self._get(self.storage, start, start + width)))
                    self._count(width, 1)
            if r1 <= r0:
                continue
            mm = self._map(k)
            lo, hi = blob.offset + r0 * width - c.start, blob.offset + r1 * width - c.start
            if len(mm) < hi:
                raise CorruptCheckpointError(
                    f"{c.path} is truncated: it has {len(mm)} bytes, the manifest puts rows up to byte {hi} in it",
                    path=c.path)
            a, b = int(np.searchsorted(ends, r0, side="right")), int(np.searchsorted(starts, r1))
            if b > a:  # groups a..b-1 have rows in this chunk
                first, last = max(int(starts[a]), r0), min(int(ends[b - 1]), r1)
                self._advise(mm, lo + (first - r0) * width, lo + (last - r0) * width)
                rows = np.minimum(ends[a:b], r1) - np.maximum(starts[a:b], r0)
                self._count(int(rows.sum()) * width, 0)
            spans.append((r0, r1, memoryview(mm)[lo:hi]))
        spans.sort(key=lambda s: s[0])
        return spans

    def _gather(self, name: str, fetch: _Fetch, sel: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``sel`` of blob ``name`` as uint8 ``[rows, width]``, copied out of their spans into ``into`` or
        memory of their own (or, for every row of a blob read in one piece, that piece itself)."""
        blob = self.payload.blobs[name]
        width = blob.nbytes // blob.shape[0] if blob.shape and blob.shape[0] else 0
        if not width:
            return torch.empty(sel.size, 0, dtype=torch.uint8)
        spans = fetch.spans[name]
        if into is None and len(spans) == 1 and spans[0][:2] == (0, sel.size) and blob.shape[0] == sel.size:
            buf = self._landed(spans[0][2])
            if len(buf) == sel.size * width:  # all rows, sorted and distinct: the span as it lies
                return torch.frombuffer(buf, dtype=torch.uint8).view(sel.size, width)
        # Copied as the widest integers that tile a row (twice as fast as bytes for 2- and 16-byte rows).
        word = next((t for t in (torch.int64, torch.int32, torch.int16) if width % t.itemsize == 0), torch.uint8)
        per_row = width // word.itemsize
        shape = (-1,) if per_row == 1 else (-1, per_row)  # one word a row: 1-D, which index_select copies faster
        if into is not None and tuple(into.shape) != (sel.size, width):
            raise ValueError(f"into for blob {name} must be uint8 [{sel.size}, {width}], got {tuple(into.shape)}")
        out = (torch.empty(sel.size, width, dtype=torch.uint8) if into is None else into).view(word).view(shape)
        for r0, r1, data in fetch.spans[name]:
            a, b = np.searchsorted(sel, [r0, r1])
            if b == a:
                continue
            view = self._span(name, r0, r1, self._landed(data), width, word).view(shape)
            first = int(sel[a]) - r0
            if int(sel[b - 1]) - r0 - first == b - a - 1:  # one run of rows (sorted and distinct): one copy
                out[a:b].copy_(view[first : first + b - a])
            else:
                torch.index_select(view, 0, torch.from_numpy(sel[a:b] - r0), out=out[a:b])
        return out.view(torch.uint8).view(sel.size, width)

    def _landed(self, data: Any) -> Any:
        """A span's bytes: as they are, or once their read lands (waiting counts as ``read_wait_ms``)."""
        return landed(data, self._stats) if isinstance(data, Future) else data

    def _get(self, storage: Storage, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of the payload, by range reads of the chunks that hold them."""
        return read_range(storage, self.payload.chunks, start, end)

    def _covering(self, start: int, end: int) -> list[int]:
        return covering(self.payload.chunks, start, end)

    def _map(self, k: int) -> Any:
        mm = self._maps.get(k)
        if mm is None:
            mm = self._maps[k] = self.storage.read_mapped(self.payload.chunks[k].path)
            self._count(0, 1)  # one request: the mapping (its pages are read as rows are copied out)
        return mm

    @staticmethod
    def _advise(mm: Any, start: int, end: int) -> None:
        if isinstance(mm, mmap.mmap) and end > start:
            first = start - start % _PAGE
            mm.madvise(mmap.MADV_WILLNEED, first, min(len(mm), end) - first)

    def _count(self, nbytes: int, reads: int) -> None:
        if self._stats is not None:
            self._stats["bytes_read"] = self._stats.get("bytes_read", 0) + nbytes
            self._stats["reads"] = self._stats.get("reads", 0) + reads


def chunk_of(payload: Payload, offset: int) -> Chunk:
    """The chunk that holds byte ``offset`` of ``payload``."""
    return next((c for c in payload.chunks if c.start <= offset < c.end), payload.chunks[-1])


def _rows_of_groups(groups: np.ndarray, size: int, n: int) -> np.ndarray:
    """Every row of groups ``groups`` (sorted) of ``size`` rows, of ``n`` rows, in order."""
    starts = groups * size
    lens = np.minimum(starts + size, n) - starts
    before = np.cumsum(lens) - lens  # rows of the groups ahead of each
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - before, lens)
