"""A rank's restore image: one file of its shards' rows and optimizer state, and the seal that vouches for it.

The image holds, for every local shard, the float32 weights, each fused optimizer state (in the
live state's dtype, ``[rows, values per row]``) and a managed-collision table's by-row state
(int64), each at a 64-byte aligned offset given by its :class:`Layout`. The file is mapped, and
every region is a tensor view of the mapping, so the process that writes the image and the one
that restores from it after a restart use the same pages: nothing is copied to keep or take it.

The seal is a second file, written whole and renamed into place (atomic), that names what the
image holds: the root (by digest), the rank and world size, the checkpoint and its chain, this
rank's payload of that checkpoint (its chunks' digests, so that a root wiped and written again with
the same ids never matches), the layout, the config that shapes rows, and the xxh3-128 of the
image's bytes. Updating an image removes the seal first and writes it last, so a process killed
part way leaves an image without a seal, which no restore uses, never a torn one that looks sealed.

Both files are the user's own, mode 0600, opened without following symlinks; a file that is not
(another user's, a link, the wrong size) is refused by name (:class:`ImageRefused`).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from cnr_torchrec.ckpt.format.blocks import ShardKey

__all__ = ["ALIGN", "ImageFile", "ImageRefused", "Layout", "Seal", "ShardLayout", "ShardViews"]

ALIGN = 64
_FORMAT = 1
_PIECE = 1 << 20  # what copy_checked hashes and copies at a time: it stays in the cache between the two


class ImageRefused(Exception):
    """An image or its seal cannot be used; the message says why (the rank then reads storage)."""


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """What an image holds of one shard: its weights' shape, its states' dtypes and widths, its by-row state's
    width (0: none)."""

    key: ShardKey
    cols: int
    rows: int
    states: tuple[tuple[str, int], ...]  # (dtype name, values per row)
    mc_fields: int = 0

    def parts(self) -> list[tuple[torch.dtype, tuple[int, int]]]:
        """(dtype, shape) of each region: the weights, each state, the by-row state."""
        out = [(torch.float32, (self.rows, self.cols))]
        out += [(getattr(torch, dtype), (self.rows, width)) for dtype, width in self.states]
        if self.mc_fields:
            out.append((torch.int64, (self.rows, self.mc_fields)))
        return out

    def to_json(self) -> list[Any]:
        return [list(self.key[1]), list(self.key[2]), self.key[0], self.rows, self.cols,
                [list(s) for s in self.states], self.mc_fields]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The shards an image holds, in order, and where each region lies."""

    shards: tuple[ShardLayout, ...]

    def offsets(self) -> list[list[tuple[int, torch.dtype, tuple[int, int]]]]:
        """Per shard, (offset, dtype, shape) of each of its regions."""
        at, out = 0, []
        for shard in self.shards:
            regions = []
            for dtype, shape in shard.parts():
                regions.append((at, dtype, shape))
                nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
                at += -(-nbytes // ALIGN) * ALIGN
            out.append(regions)
        return out

    @property
    def nbytes(self) -> int:
        regions = [r for rs in self.offsets() for r in rs]
        if not regions:
            return 0
        at, dtype, shape = regions[-1]
        return at + shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()

    def digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(json.dumps([s.to_json() for s in self.shards]).encode())


@dataclasses.dataclass(frozen=True)
class Seal:
    """What a sealed image holds: see the module's docstring."""

    root: str  # the root's digest
    rank: int
    world_size: int
    ckpt_id: int
    chain: tuple[int, ...]
    payload: str  # this rank's payload of the checkpoint: its chunks' digests, joined
    layout: str  # Layout.digest()
    config: str  # the digest of the config that shapes rows
    nbytes: int
    checksum: str  # xxh3-128 of the image's bytes

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, **dataclasses.asdict(self), "chain": list(self.chain)}

    @classmethod
    def from_json(cls, body: Any, where: str) -> Seal:
        try:
            if body.pop("format") != _FORMAT:
                raise ImageRefused(f"{where}: a seal of another format")
            fields = {f.name for f in dataclasses.fields(cls)}
            if set(body) != fields:
                raise ImageRefused(f"{where}: the seal's fields are {sorted(body)}, not {sorted(fields)}")
            return cls(**{**body, "chain": tuple(int(i) for i in body["chain"])})
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ImageRefused(f"{where}: a malformed seal ({type(e).__name__}: {e})") from None


@dataclasses.dataclass(frozen=True)
class ShardViews:
    """Tensor views of one shard's regions of a mapped image."""

    weights: torch.Tensor
    states: tuple[torch.Tensor, ...]
    mc: torch.Tensor | None


def _open_own(path: str, flags: int) -> int:
    """``os.open`` of the user's own regular file at ``path``, never through a symlink, mode 0600 checked.

    Raises:
        ImageRefused: a symlink, not a regular file, another user's, or readable by others.
        FileNotFoundError: no file (without ``O_CREAT``).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        if e.errno == 40:  # ELOOP: a symlink under O_NOFOLLOW
            raise ImageRefused(f"{path} is a symlink; an image is a regular file of the job's user") from None
        raise
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid != os.getuid():
        why = f"belongs to uid {st.st_uid}, not this job's {os.getuid()}"
    elif st.st_mode & 0o077:
        why = f"has mode {oct(st.st_mode & 0o777)}; an image is 0600"
    if why is not None:
        os.close(fd)
        raise ImageRefused(f"{path} {why}")
    return fd


class ImageFile:
    """One rank's image (``<stem>.img``) and seal (``<stem>.seal``), mapped once opened.

    Args:
        stem: the files' path without suffix.
    """

    def __init__(self, stem: str) -> None:
        self.data_path, self.seal_path = stem + ".img", stem + ".seal"
        self.layout: Layout | None = None
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._views: dict[ShardKey, ShardViews] = {}

    # ------------------------------------------------------------------ mapping

    def open(self, layout: Layout, create: bool) -> None:
        """Maps the image for ``layout``: the existing file (which must have its size), or with ``create`` a new
        zeroed one in its place.

        Raises:
            ImageRefused: the existing file is refused (:func:`_open_own`) or has another size (without
                ``create``).
            OSError: the file could not be made (a full or missing directory).
        """
        self.close()
        if create:
            self.unseal()
            self._remove(self.data_path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _open_own(self.data_path, flags)
        try:
            size = os.fstat(fd).st_size
            if create:
                os.posix_fallocate(fd, 0, max(layout.nbytes, 1))  # the pages now: ENOSPC here, not SIGBUS later
            elif size != max(layout.nbytes, 1):
                raise ImageRefused(f"{self.data_path} holds {size} bytes; this rank's shards need "
                                   f"{layout.nbytes} (another layout, or truncated)")
            self._map = mmap.mmap(fd, max(layout.nbytes, 1))
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.layout = layout
        self._views = {}
        for shard, regions in zip(layout.shards, layout.offsets()):
            views = []
            for at, dtype, shape in regions:
                n = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
                views.append(self._bytes[at:at + n].view(dtype).view(shape))
            mc = views.pop() if shard.mc_fields else None
            self._views[shard.key] = ShardViews(views[0], tuple(views[1:]), mc)

    def views(self, key: ShardKey) -> ShardViews:
        return self._views[key]

    def holds(self, key: ShardKey) -> bool:
        return key in self._views

    @property
    def is_open(self) -> bool:
        return self._map is not None

    def close(self) -> None:
        """Lets go of the mapping (the files stay). It is unmapped once no view of it is left: each view holds
        the mapping (``torch.frombuffer`` keeps a reference), so one still in use never points at unmapped
        memory."""
        self._views = {}
        self._bytes = None
        self._map = None
        self.layout = None

    def remove(self) -> None:
        """Unmaps and deletes both files."""
        self.close()
        self.unseal()
        self._remove(self.data_path)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ sealing

    def checksum(self) -> str:
        assert self._map is not None, "open the image first"
        return xxhash.xxh3_128_hexdigest(memoryview(self._map))

    def copy_checked(self, into: Mapping[ShardKey, Sequence[torch.Tensor | None]]) -> str:
        """Copies regions of the image into tensors as it checksums it, in one pass: each piece is hashed and then
        copied while it is in the cache. Returns the checksum of the image's bytes (what :meth:`checksum` gives).

        Args:
            into: per shard, a tensor per region (:meth:`ShardLayout.parts` order: the weights, each state, the
                by-row state) to copy it into, contiguous and of the region's size in bytes; None (or a shorter
                list): that region is only hashed.
        """
        assert self._map is not None and self.layout is not None and self._bytes is not None, "open the image first"
        digest, raw, at = xxhash.xxh3_128(), memoryview(self._map), 0
        for shard, regions in zip(self.layout.shards, self.layout.offsets()):
            targets = list(into.get(shard.key, ()))
            for i, (start, dtype, shape) in enumerate(regions):
                digest.update(raw[at:start])  # the padding before the region
                n = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
                target = targets[i] if i < len(targets) else None
                flat = None if target is None else target.view(-1).view(torch.uint8)
                if flat is not None and flat.numel() != n:
                    raise ValueError(f"shard {shard.key} region {i}: {flat.numel()} bytes to copy into, {n} held")
                for lo in range(0, n, _PIECE):
                    hi = min(n, lo + _PIECE)
                    digest.update(raw[start + lo:start + hi])
                    if flat is not None:
                        flat[lo:hi].copy_(self._bytes[start + lo:start + hi])
                at = start + n
        digest.update(raw[at:])
        return digest.hexdigest()

    def unseal(self) -> None:
        """Removes the seal: from now on no restore takes the image, until :meth:`seal`."""
        self._remove(self.seal_path)

    def seal(self, fields: Mapping[str, Any]) -> Seal:
        """Checksums the image and writes its seal (whole, then renamed into place). ``fields``: the seal's
        fields but ``nbytes`` and ``checksum``."""
        assert self.layout is not None, "open the image first"
        seal = Seal(**fields, layout=self.layout.digest(), nbytes=self.layout.nbytes, checksum=self.checksum())
        tmp = f"{self.seal_path}.{os.getpid()}.tmp"
        fd = _open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, json.dumps(seal.to_json()).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.seal_path)
        return seal

    def read_seal(self) -> Seal:
        """The seal as written.

        Raises:
            ImageRefused: no seal (the image was being updated, or never sealed), or a seal refused by
                :func:`_open_own` or malformed.
        """
        try:
            fd = _open_own(self.seal_path, os.O_RDONLY)
        except FileNotFoundError:
            raise ImageRefused(f"{self.seal_path} does not exist: the image is not sealed (never sealed, or "
                               "its process was stopped while updating it)") from None
        try:
            raw = b""
            while chunk := os.read(fd, 1 << 16):
                raw += chunk
        finally:
            os.close(fd)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ImageRefused(f"{self.seal_path}: a malformed seal ({e})") from None
        return Seal.from_json(body, self.seal_path)

