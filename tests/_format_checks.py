"""Helpers the format's unit tests share: a reference checksum, a blob read by range, a state tree round trip."""

from __future__ import annotations

import json

import xxhash

from cnr_torchrec.ckpt.format.bytes.chunks import PayloadReader
from cnr_torchrec.ckpt.format.bytes.payload import BlobWriter, flatten_state, unflatten_state
from cnr_torchrec.ckpt.format.schema import check_payload


def flip_bytes(path: str, every: int = 512, first: int | None = None) -> None:
    """Damages the file at ``path`` in place: flips every bit of one byte in every ``every``, from byte ``first``
    (half of ``every`` unless given), so that each CRC group or chunk it spans fails its check."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for at in range(every // 2 if first is None else first, len(data), every):
            data[at] ^= 0xFF
        f.seek(0)
        f.write(data)


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


# ---------------------------------------------------------------------- a checkpoint as one body

def combined_body(storage, ckpt_id):
    """Checkpoint ``ckpt_id``'s manifest body with every rank's report under ``ranks``, as format 6 held them: a
    format 7 index with its parts read in (without their ``ckpt`` key) and its ``parts`` lines left out. A test
    edits it as one document and writes it back with :func:`write_combined`."""
    from cnr_torchrec.ckpt.format.commits import part_path, read_body
    from cnr_torchrec.ckpt.format.parts import expand_part

    body = read_body(storage, ckpt_id)
    if "parts" not in body:
        return body
    ranks = []
    for r in range(len(body["parts"])):
        part = expand_part(json.loads(storage.read(part_path(ckpt_id, r))))
        part.pop("ckpt", None)
        ranks.append(part)
    out = {k: v for k, v in body.items() if k != "parts"}
    out["ranks"] = ranks
    return out


def write_combined(storage, ckpt_id, body, key=None):
    """Writes ``body`` (as :func:`combined_body` gives it, edited) back as a crafted or buggy writer with ``key``
    (None: no key) would: each rank's part rewritten and its size and digest in the index made to match, the
    index's other lines left as they were, the index re-sealed. On a format 6 root, the manifest re-sealed."""
    from cnr_torchrec.ckpt.format.bytes.integrity import chunk_hasher, chunk_record
    from cnr_torchrec.ckpt.format.commits import manifest_path, part_path, seal

    on_disk = json.loads(storage.read(manifest_path(ckpt_id)))
    if "parts" not in on_disk["body"] or not isinstance(body.get("ranks"), list):
        storage.write_atomic(manifest_path(ckpt_id), seal(body, version=on_disk["version"], key=key))
        return
    lines = [dict(line) for line in on_disk["body"]["parts"]]
    for r, report in enumerate(body["ranks"][: len(lines)]):
        data = json.dumps({"ckpt": ckpt_id, **report} if isinstance(report, dict) else report,
                          separators=(",", ":")).encode()
        storage.write_atomic(part_path(ckpt_id, r), data)
        digest = chunk_hasher(key)
        digest.update(data)
        for name in ("xxh3", "blake2b"):
            lines[r].pop(name, None)
        lines[r].update(chunk_record(key, len(data), digest.hexdigest()))
    index = {k: v for k, v in body.items() if k != "ranks"}
    index["parts"] = lines
    storage.write_atomic(manifest_path(ckpt_id), seal(index, key=key))


def _root_and_id(manifest_file):
    """(root, checkpoint id) of a manifest's path on the local filesystem."""
    import os

    ckpt = os.path.dirname(manifest_file)
    return os.path.dirname(ckpt), int(os.path.basename(ckpt).removeprefix("ckpt-"))


def read_combined_at(manifest_file):
    """:func:`combined_body` of the checkpoint whose manifest is at ``manifest_file`` (a local path)."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root, cid = _root_and_id(manifest_file)
    storage = Storage(root)
    try:
        return combined_body(storage, cid)
    finally:
        storage.close()


def write_combined_at(manifest_file, body, key=None):
    """:func:`write_combined` into the checkpoint whose manifest is at ``manifest_file`` (a local path)."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root, cid = _root_and_id(manifest_file)
    storage = Storage(root)
    try:
        write_combined(storage, cid, body, key)
    finally:
        storage.close()


def snapshot_dir(manifest_file):
    """Every file of the checkpoint whose manifest is at ``manifest_file``, by path, as bytes."""
    import glob
    import os

    return {p: open(p, "rb").read() for p in glob.glob(os.path.join(os.path.dirname(manifest_file), "*"))}


def put_back(snapshot):
    """Writes back the files :func:`snapshot_dir` took."""
    for path, data in snapshot.items():
        with open(path, "wb") as f:
            f.write(data)
