"""Chunked payloads: round trips across chunk boundaries, corrupt and missing chunks named, a real
checkpoint cut into many chunks on the filesystem and on S3, and a format-3 (one-file) checkpoint read back.

The references are the tensors that were written, and the live model (through the codec's own
image of each row, as in test_checkpointer_multirank.py).
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from _format_checks import combined_body

from cnr_torchrec.ckpt.format.bytes.chunks import IOPool, PayloadReader, PayloadWriter
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.schema import check_payload
from cnr_torchrec.errors import CorruptCheckpointError

CHUNK = 4096


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "small": torch.randn(10, generator=g),
        "spans_two": torch.randn(1500, generator=g),  # 6,000 bytes: crosses a 4,096-byte boundary
        "spans_four": torch.randint(-2**31, 2**31 - 1, (3000,), generator=g, dtype=torch.int64),  # 24,000 bytes
        "empty": torch.zeros(0, 3),
        "bytes": torch.randint(0, 255, (4096,), generator=g, dtype=torch.uint8),  # exactly one stride
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),
    }


def _write(storage, pool=None, file="ckpt-00000001/rank-00000.bin", chunk=CHUNK, in_flight=None):
    w = PayloadWriter(storage, file, chunk, pool, in_flight)
    for name, t in _tensors().items():
        w.add(name, t)
    return {"rank": 0, **w.finish()}


def _payload(report):
    """The payload a manifest's report describes, as the schema check builds it."""
    return check_payload(json.loads(json.dumps(report)), "report")


@pytest.fixture
def storage(tmp_path):
    s = Storage(str(tmp_path))
    yield s
    s.close()


@pytest.mark.parametrize("threads", [0, 3])
def test_round_trip_across_chunk_boundaries(storage, tmp_path, threads):
    pool = IOPool(str(tmp_path), None, threads) if threads else None
    try:
        report = _write(storage, pool, in_flight=1 if threads else None)
        files = sorted(glob.glob(str(tmp_path / "ckpt-00000001" / "*")))
        sizes = [os.path.getsize(f) for f in files]
        assert len(files) == -(-report["nbytes"] // CHUNK) >= 9 and max(sizes) == CHUNK and sum(sizes) == report[
            "nbytes"]
        for whole in (True, False):
            reader = PayloadReader(storage, _payload(report), whole=whole, pool=pool)
            for name, t in _tensors().items():
                got = reader(name)
                assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), (name, whole)
    finally:
        if pool is not None:
            pool.close()


def test_a_corrupt_chunk_is_named(storage, tmp_path):
    report = _write(storage)
    bad = _payload(report).chunks[2]
    path = tmp_path / bad.path
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="rank-00000.2.bin does not match its xxh3") as e:
        PayloadReader(storage, _payload(report))("spans_four")
    assert e.value.path == "ckpt-00000001/rank-00000.2.bin"
    # A blob read by range is checked against its own checksum, and names the payload.
    with pytest.raises(CorruptCheckpointError, match="blob spans_four does not match its checksum"):
        PayloadReader(storage, _payload(report), whole=False)("spans_four")
    assert torch.equal(PayloadReader(storage, _payload(report), whole=False)("small"), _tensors()["small"])


def test_a_missing_or_short_chunk_is_named(storage, tmp_path):
    report = _write(storage)
    last = _payload(report).chunks[-1]
    os.remove(tmp_path / last.path)
    with pytest.raises(Exception, match=f"{last.path} does not exist"):
        PayloadReader(storage, _payload(report))("half")
    os.truncate(tmp_path / _payload(report).chunks[1].path, 100)
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000.1.bin is 100 bytes, its manifest says 4096 \(trunc"):
        PayloadReader(storage, _payload(report))("spans_two")


def test_a_failed_chunk_write_fails_the_payload(storage, tmp_path):
    os.makedirs(tmp_path / "ckpt-00000001")
    os.makedirs(tmp_path / "ckpt-00000001" / "rank-00000.3.bin")  # a directory where chunk 3 goes
    pool = IOPool(str(tmp_path), None, 2)
    try:
        with pytest.raises(IsADirectoryError):
            _write(storage, pool)
    finally:
        pool.close()


def test_the_chunk_size_is_checked():
    from cnr_torchrec import ConfigError, load_config

    for bad in (1000, 4097, 6 << 30):
        with pytest.raises(ConfigError, match="chunk_bytes: must be a multiple of 4096"):
            load_config({"root": "/x", "chunk_bytes": bad})
    with pytest.raises(ConfigError, match="io_threads"):
        load_config({"root": "/x", "io_threads": 0})


# ---------------------------------------------------------------------- whole checkpoints


def _saved_and_restored(rank, world_size, root, options, chunk_bytes, rewrite=None):
    """Baseline + 2 deltas of the five-table toy model (every sharding type) in chunks of ``chunk_bytes``,
    restored into a fresh model; ``rewrite(root)`` runs on rank 0 between the two. Returns the largest
    payload object and the number of objects per rank report, after asserting the restore."""
    import torch.distributed as dist
    from _toy import local_state, train
    from test_checkpointer_multirank import _build, _config

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.quant import get_codec

    quant = {"params": {"bias_dtype": "float16"}, "state_dtype": "bfloat16"}
    config = _config(root, "consecutive", "adaptive", 4, quant, chunk_bytes=chunk_bytes, io_threads=3,
                     storage_options=options)
    dmp, specs, opt = _build(world_size)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ckpt:
        gen = torch.Generator().manual_seed(rank)
        for step in range(1, 4):
            train(dmp, specs, opt, 2, gen)
            ckpt.save(step).wait()
        infos = ckpt.list()
    saved = local_state(dmp)
    if rank == 0 and rewrite is not None:
        rewrite(root)
    dist.barrier()
    storage = Storage(root, options)
    try:
        from cnr_torchrec.ckpt.format.commits import load_manifest

        reports = [r for i in infos for r in load_manifest(storage, i.id).ranks]
        sizes = [storage.size(c.path) for r in reports for c in r.payload.chunks]
        counts = [len(r.payload.chunks) for r in reports]
    finally:
        storage.close()
    fresh, _, opt2 = _build(world_size, seed=1)
    with Checkpointer(fresh, config, dense_optimizer=opt2) as restorer:
        assert restorer.restore() == 3
    codec = get_codec("adaptive", 4, bias_dtype="float16")
    got = local_state(fresh)
    for key, ref in saved.items():
        sharded = isinstance(key, tuple) and not fresh.dirty_tracker.is_data_parallel(key[0])
        if key[-1] == "w" and sharded:
            ref = codec.decode(codec.encode(ref.float()))
        elif isinstance(key, tuple) and key[-1] != "w" and sharded:
            ref = ref.to(torch.bfloat16).to(ref.dtype)
        assert torch.equal(got[key], ref), key
    return max(sizes), counts


def _chunked_fs(rank, world_size, root):
    biggest, counts = _saved_and_restored(rank, world_size, root, {}, CHUNK)
    assert biggest <= CHUNK and max(counts) > 5, counts


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_checkpoint_in_many_chunks_restores(tmp_path):
    from _dist import run_ranks

    run_ranks(_chunked_fs, 2, args=(str(tmp_path),), timeout=200)


def _as_format_3(root):
    """Rewrites every manifest under ``root`` as format 3 wrote it: each rank's payload one file."""
    from cnr_torchrec.ckpt.format.bytes.storage import checksum
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest, manifest_path, seal

    storage = Storage(root)
    try:
        for i in committed_ids(storage):
            body = combined_body(storage, i)
            for r, report in zip(body["ranks"], load_manifest(storage, i).ranks):
                data = b"".join(bytes(storage.read(c.path)) for c in report.payload.chunks)
                for c in report.payload.chunks[1:]:
                    storage.delete(c.path)
                storage.write(r["file"], data)
                del r["chunks"], r["chunk_bytes"]
                r["xxh3"] = checksum(data)
            storage.write_atomic(manifest_path(i), seal(body, version=3))
    finally:
        storage.close()


def _format_3(rank, world_size, root):
    _, counts = _saved_and_restored(rank, world_size, root, {}, CHUNK, rewrite=_as_format_3)
    assert set(counts) == {1}, counts  # read back after the rewrite: one file per rank report


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_format_3_checkpoint_still_restores(tmp_path):
    from _dist import run_ranks

    run_ranks(_format_3, 2, args=(str(tmp_path),), timeout=200)


@pytest.fixture(scope="module")
def moto():
    pytest.importorskip("moto")
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import reliability as R

    server = R.Moto()
    yield server
    server.close()


def _chunked_s3(rank, world_size, root, options):
    biggest, counts = _saved_and_restored(rank, world_size, root, options, CHUNK)
    assert biggest <= CHUNK and max(counts) > 5, counts


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_payload_larger_than_a_chunk_on_s3(moto):
    from _dist import run_ranks

    root = f"s3://{moto.bucket}/chunked"
    run_ranks(_chunked_s3, 2, args=(root, moto.options), timeout=200)
    keys = moto.keys("chunked/")
    assert any(k.endswith("rank-00000.5.bin") for k in keys), keys[:10]
