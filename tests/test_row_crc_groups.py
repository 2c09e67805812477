"""Row reads check every check group they use, the last one and an entry's only one included.

tests/test_row_reads.py flips the first stored row of an entry; here the byte flipped is in the
last stored row, whose group is the entry's last (a partial one in each entry here) or, for a
table of fewer rows than a group holds, its only one. Every xxh3 that covers the byte (its
chunk's, its blob's, the manifest's) is recomputed after the flip, as a crafted or buggy writer
would leave it, so that the row's CRC-32C is the only check that can see it. Both a real restore
and :class:`~cnr_torchrec.ckpt.format.bytes.rows.RowReader` must name the group's rows; a read of rows in
the other groups alone gives back the stored bytes. The RowReader runs on a local root (the
groups hashed where they lie in the mapped file) and on S3 under moto (the groups copied out of
range reads first).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from _format_checks import combined_body, write_combined
from _toy import build_dmp, train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import reliability as R  # noqa: E402

# The entries of the tip flipped here: table -> (its entry's columns, its check groups). ``wide`` stores the
# rows a row bitmap names, ``cols`` is a column shard, ``tiny`` fits in one group.
TIP_ENTRIES = {"wide": ((0, 8), 3), "cols": ((0, 4), 2), "tiny": ((0, 8), 1)}


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("wide", 300, 8, "row_wise"), TableSpec("tiny", 6, 8, "table_wise"),
            TableSpec("cols", 200, 8, "column_wise")]


def _config(root: str, **kw):
    from cnr_torchrec import load_config

    # float32 rows; a damaged tip fails the restore instead of falling back to the baseline.
    return load_config({"root": root, "quantization": {"method": "none"}, "on_corrupt": "fail", **kw})


@pytest.fixture(scope="module")
def chain(group, tmp_path_factory):
    """A baseline and a delta of the toy model (float32 rows); the path of the root."""
    from cnr_torchrec import Checkpointer

    root = str(tmp_path_factory.mktemp("crc_groups") / "root")
    specs = _specs()
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        for step in (1, 2):
            train(dmp, specs, opt, 2, gen)
            ck.save(step).wait()
    return root


def _entry(storage, ckpt_id: int, table: str, cols: tuple[int, int]):
    """(rank report, entry) of ``table``'s entry for columns ``cols`` in checkpoint ``ckpt_id``."""
    from cnr_torchrec.ckpt.format.commits import load_manifest

    return next((report, e) for report, t, e in load_manifest(storage, ckpt_id).entries()
                if t == table and e.cols == cols)


def _flip_last_row(storage, ckpt_id: int, table: str, cols: tuple[int, int]) -> tuple[str, bytes]:
    """Flips a byte of the last stored row of the entry's encoded weights and reseals every xxh3 over it.

    Returns:
        The file flipped, and the entry's encoded weights as they were before.
    """
    from cnr_torchrec.ckpt.format.bytes.payload import checksum
    from cnr_torchrec.ckpt.format.commits import manifest_path, seal

    report, e = _entry(storage, ckpt_id, table, cols)
    name = e.weights.blobs["payload"]
    blob = report.payload.blobs[name]
    (k, chunk), = [(k, c) for k, c in enumerate(report.payload.chunks) if c.start <= blob.offset < c.end]
    assert blob.end <= chunk.end, "the toy's payload is one chunk"
    data = bytearray(storage.read(chunk.path))
    lo = blob.offset - chunk.start
    before = bytes(data[lo : lo + blob.nbytes])
    width = blob.nbytes // e.num_stored
    data[lo + (e.num_stored - 1) * width + width // 2] ^= 0x10
    storage.write_atomic(chunk.path, bytes(data))
    body = combined_body(storage, ckpt_id)
    raw = next(r for r in body["ranks"] if r["rank"] == report.rank)
    raw["chunks"][k]["xxh3"] = checksum(bytes(data))
    raw["blobs"][name]["xxh3"] = checksum(bytes(data[lo : lo + blob.nbytes]))
    write_combined(storage, ckpt_id, body)
    return chunk.path, before


def _last_group(e) -> tuple[int, int]:
    """The first and last stored row of the entry's last check group."""
    return (e.num_stored - 1) // e.checks.rows * e.checks.rows, e.num_stored - 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("table", sorted(TIP_ENTRIES))
def test_a_restore_names_a_flip_in_the_last_check_group(chain, tmp_path, table):
    from cnr_torchrec import Checkpointer, CorruptCheckpointError
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    cols, groups = TIP_ENTRIES[table]
    root = str(tmp_path / "root")
    shutil.copytree(chain, root)
    storage = Storage(root)
    try:
        _, e = _entry(storage, 1, table, cols)
        assert -(-e.num_stored // e.checks.rows) == groups and e.num_stored % e.checks.rows, e  # a partial last
        file, _ = _flip_last_row(storage, 1, table, cols)
    finally:
        storage.close()
    first, last = _last_group(e)
    dmp, opt = build_dmp(_specs(), seed=1)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        with pytest.raises(CorruptCheckpointError) as raised:
            ck.restore()
    assert raised.value.path == file
    assert (f"{file}: stored rows {first} to {last} of the entry for rows [{e.rows[0]}, {e.rows[1]}) do not match "
            "their CRC-32C") in str(raised.value), str(raised.value)


@pytest.fixture(params=["fs", "s3"])
def damaged(request, chain, tmp_path):
    """The chain with the last stored row flipped in every entry of TIP_ENTRIES (checkpoint 1) and in the
    baseline's ``wide`` entry (checkpoint 0, all 300 rows), on a local root or on S3; (storage, the encoded weights
    of each flipped entry before the flip by (ckpt id, table, columns))."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    server = None
    if request.param == "fs":
        root, options = str(tmp_path / "root"), None
        shutil.copytree(chain, root)
    else:
        pytest.importorskip("moto")
        server = R.Moto()
        root, options = f"s3://{server.bucket}/crc-groups", server.options
    storage = Storage(root, options)
    try:
        if server is not None:
            for d, _, files in os.walk(chain):
                for f in files:
                    path = os.path.join(d, f)
                    with open(path, "rb") as src:
                        storage.write(os.path.relpath(path, chain), src.read())
        before = {(1, t, cols): _flip_last_row(storage, 1, t, cols)[1] for t, (cols, _) in TIP_ENTRIES.items()}
        before[(0, "wide", (0, 8))] = _flip_last_row(storage, 0, "wide", (0, 8))[1]
        yield storage, before
    finally:
        storage.close()
        if server is not None:
            server.close()


@pytest.mark.timeout(120)
def test_row_reader_checks_the_last_and_the_only_check_group(damaged):
    from cnr_torchrec import CorruptCheckpointError
    from cnr_torchrec.ckpt.format.bytes.rows import RowReader

    storage, before = damaged
    for (ckpt_id, table, cols), stored in before.items():
        report, e = _entry(storage, ckpt_id, table, cols)
        first, last = _last_group(e)
        rows = torch.frombuffer(bytearray(stored), dtype=torch.uint8).view(e.num_stored, -1)
        asked = {"every row": torch.arange(e.num_stored), "the last row": torch.tensor([last]),
                 "the last group's first row": torch.tensor([first])}
        for what, sel in asked.items():
            with pytest.raises(CorruptCheckpointError, match=f"stored rows {first} to {last} of the entry") as got:
                RowReader(storage, report.payload).rows(e, sel)
            assert got.value.path == report.payload.chunks[0].path, (ckpt_id, table, what)
        if first:  # the groups before the last one are sound, and read back as they were stored
            sel = torch.arange(0, first, 3)
            read = RowReader(storage, report.payload).rows(e, sel)
            assert torch.equal(read[0], rows[sel]), (ckpt_id, table)
