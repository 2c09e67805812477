"""Helpers the format's unit tests share: a reference checksum, a blob read by range, a state tree round trip."""

from __future__ import annotations

import json

import xxhash

from cnr_torchrec.ckpt.format.chunks import PayloadReader
from cnr_torchrec.ckpt.format.payload import BlobWriter, flatten_state, unflatten_state
from cnr_torchrec.ckpt.format.schema import check_payload


def xxh3_reference(data: bytes) -> str:
    """XXH3-128 from xxhash's own binding of the reference C library, as hex."""
    return xxhash.xxh3_128_hexdigest(bytes(data))


def range_read(storage, file, index, name):
    """One blob by a range read, as restore reads a few small blobs of a big payload (a one-file report)."""
    payload = check_payload({"file": file, "nbytes": 1 << 40, "xxh3": "", "blobs": index}, "report")
    return PayloadReader(storage, payload, whole=False)(name)


def round_trip(storage, obj, name="ckpt-00000000/rank-00000.bin"):
    """flatten -> JSON text + payload file -> read back -> unflatten."""
    blobs = BlobWriter()
    tree = flatten_state(obj, "x", blobs, "x")
    text = json.dumps(tree)
    storage.write(name, blobs.getvalue())
    index = json.loads(json.dumps(blobs.index))
    return unflatten_state(json.loads(text), lambda b: range_read(storage, name, index, b))
