"""Per-rank payload files: raw tensor bytes back to back, described by JSON. No pickle.

A payload file is the concatenation of blobs. Each blob is one tensor's bytes; its
offset, size, dtype, shape and xxh3 go in the manifest, so a reader can fetch just
the byte range it needs and check it. Nested state (optimizer, reader, RNG) is split
into a JSON tree and the tensors it holds (:func:`flatten_state`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from cnr_torchrec.ckpt.format.bytes.storage import checksum
from cnr_torchrec.ckpt.format.manifest import Blob
from cnr_torchrec.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["DTYPES", "BlobSink", "BlobWriter", "read_blob", "flatten_state", "unflatten_state", "checksum"]

# The dtypes a blob may hold, by the name a manifest gives them; nothing else is written or read.
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
              torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if str(t.dtype).removeprefix("torch.") not in DTYPES:
        raise CheckpointError(f"cannot store a tensor of dtype {t.dtype}; supported: {sorted(DTYPES)}")
    return t.reshape(-1).view(torch.uint8).numpy().data


class BlobWriter:
    """Collects tensors for one payload file."""

    def __init__(self) -> None:
        self._parts: list[memoryview] = []
        self._offset = 0
        self.index: dict[str, dict[str, Any]] = {}

    ALIGN = 64  # every blob starts on a cache line, so readers can view it in place

    def add(self, name: str, tensor: torch.Tensor) -> str:
        if name in self.index:
            raise ValueError(f"blob {name!r} added twice")  # a bug in the caller
        data = _as_bytes(tensor)
        pad = -self._offset % self.ALIGN
        if pad:
            self._append(memoryview(bytes(pad)))
            self._offset += pad
        self.index[name] = {
            "offset": self._offset,
            "nbytes": data.nbytes,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "xxh3": checksum(data),
        }
        self._append(data)
        self._offset += data.nbytes
        return name

    def _append(self, data: memoryview) -> None:
        """Takes the payload's next bytes (kept in memory here; streamed out by a PayloadWriter)."""
        self._parts.append(data)

    @property
    def nbytes(self) -> int:
        return self._offset

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


def read_blob(file: str, blob: Blob, what: str, data: Any) -> torch.Tensor:
    """The tensor of one blob, from its bytes ``data``, checked against its size and checksum.

    Args:
        data: the blob's bytes. A writable memoryview (of a bytearray or a private mmap) is
            shared by the returned tensor, not copied.

    Raises:
        CorruptCheckpointError: the bytes are missing, short, or do not match the checksum.
        UnsafeCheckpointError: the dtype is one we never write.
    """
    start, nbytes = blob.offset, blob.nbytes
    dtype = DTYPES.get(blob.dtype)
    if dtype is None:
        raise UnsafeCheckpointError(f"{file}: blob {what} has dtype {blob.dtype!r}, which we never write")
    if len(data) != nbytes:
        raise CorruptCheckpointError(
            f"{file} is truncated: blob {what} needs bytes [{start}, {start + nbytes}), got {len(data)}",
            path=file,
        )
    if checksum(data) != blob.xxh3:
        raise CorruptCheckpointError(f"{file}: blob {what} does not match its checksum", path=file)
    if not nbytes:
        out = torch.empty(0, dtype=torch.uint8)
    elif isinstance(data, memoryview) and not data.readonly:
        out = torch.frombuffer(data, dtype=torch.uint8)  # shares the caller's buffer: no copy
    else:
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.view(dtype).reshape(blob.shape)


# ---------------------------------------------------------------------- nested state

_TENSOR, _TUPLE, _ITEMS, _FLOAT = "$tensor", "$tuple", "$items", "$float"


class BlobSink(Protocol):
    """Where :func:`flatten_state` puts each tensor: returns the name it is stored under."""

    def add(self, name: str, tensor: torch.Tensor) -> str: ...


def flatten_state(obj: Any, prefix: str, blobs: BlobSink, where: str) -> Any:
    """Returns a JSON-able tree for ``obj``; its tensors go to ``blobs`` under ``prefix``.

    Dicts with non-string keys (optimizer states) and tuples are kept as such.

    Raises:
        CheckpointError: ``obj`` holds something other than tensors, numbers, strings,
            None, lists, tuples and dicts (we never pickle).
    """
    if isinstance(obj, torch.Tensor):
        return {_TENSOR: blobs.add(f"{prefix}", obj)}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT: repr(obj)}  # JSON has no inf/nan (schedulers keep inf as "best so far")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [flatten_state(v, f"{prefix}/{i}", blobs, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: flatten_state(v, f"{prefix}/{k}", blobs, f"{where}[{k!r}]") for k, v in obj.items()}
        items = []
        for i, (k, v) in enumerate(obj.items()):
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise CheckpointError(f"{where}: dict key {k!r} of type {type(k).__name__} cannot be stored")
            items.append([k, flatten_state(v, f"{prefix}/{i}", blobs, f"{where}[{k!r}]")])
        return {_ITEMS: items}
    raise CheckpointError(
        f"{where} holds a {type(obj).__name__}, which cannot be stored without pickle. "
        "Make state_dict() return tensors, numbers, strings, None, lists, tuples or dicts."
    )


def unflatten_state(tree: Any, load: Any) -> Any:
    """Inverse of :func:`flatten_state`; ``load(name)`` returns a stored tensor."""
    if isinstance(tree, list):
        return [unflatten_state(v, load) for v in tree]
    if isinstance(tree, dict):
        if _TENSOR in tree:
            return load(tree[_TENSOR])
        if _FLOAT in tree:
            return float(tree[_FLOAT])
        if _TUPLE in tree:
            return tuple(unflatten_state(v, load) for v in tree[_TUPLE])
        if _ITEMS in tree:
            return {k: unflatten_state(v, load) for k, v in tree[_ITEMS]}
        return {k: unflatten_state(v, load) for k, v in tree.items()}
    return tree
