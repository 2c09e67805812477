"""Restores that read only the rows they apply (format 5), on a local root and on S3 (moto).

The restores are checked against the model's own state saved at each step: a flipped byte
in a row a restore reads is named, one in a group of rows it reads around leaves the restore
exact and ``verify_root`` still names it, and a format 4 checkpoint (no row checks) is still
read whole. ``torch.ops.cnr.row_crc32c`` itself: tests/test_row_crc32c.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from _format_checks import combined_body, write_combined

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import reliability as R  # noqa: E402


# ---- restores -------------------------------------------------------------------------------

def _specs():
    from examples.toy import TableSpec

    # row_wise and column_wise shards, a table-wise one and a data_parallel table; t0's 48-byte rows straddle 4 KiB
    return [TableSpec("t0", 600, 12, "row_wise", "ebc"), TableSpec("t1", 400, 8, "column_wise", "ebc"),
            TableSpec("t2", 300, 4, "table_wise", "ebc"), TableSpec("t3", 40, 4, "data_parallel", "ebc")]


def _config(root: str, options: dict | None = None, **kw):
    from cnr_torchrec import load_config

    # float32 rows, so that a restore must give back the trained model's state bit for bit
    return load_config({"root": root, "policy": "consecutive", "storage_options": options or {},
                        "quantization": {"method": "none"}, **kw})


def _chain(root: str, options: dict | None = None, deltas: int = 3, **config):
    """A baseline and ``deltas`` deltas of a trained toy model; returns (dmp, opt, state after the last save)."""
    from _toy import build_dmp, local_state, train

    from cnr_torchrec import Checkpointer

    specs = _specs()
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, _config(root, options, **config), dense_optimizer=opt) as ck:
        for step in range(deltas + 1):
            train(dmp, specs, opt, 3, gen)
            _sweep_t2(dmp, specs, opt)
            ck.save(step).wait()
    return dmp, opt, local_state(dmp)


def _sweep_t2(dmp, specs, opt) -> None:
    """A step that looks up every row of t2, so that each delta stores all of t2 again (the older copies of
    its rows are then never read)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rows = next(s.rows for s in specs if s.name == "t2")
    gen = torch.Generator().manual_seed(rows)
    values = [torch.arange(rows) if s.name == "t2" else torch.randint(0, s.rows, (rows,), generator=gen)
              for s in specs]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[s.feature for s in specs], values=torch.cat(values),
                                              lengths=torch.ones(rows * len(specs), dtype=torch.int64))
    dmp(kjt).backward()
    opt.step()
    opt.zero_grad()


def _restore(dmp, opt, root: str, options: dict | None = None, on_corrupt: str = "fail", **config):
    """Scrambles the model, restores the newest checkpoint; returns (state, stats)."""
    from _toy import local_state

    from cnr_torchrec import Checkpointer

    with torch.no_grad():
        for p in dmp.parameters():
            p.add_(1.0)
    with Checkpointer(dmp, _config(root, options, on_corrupt=on_corrupt, **config), dense_optimizer=opt) as ck:
        ck.restore()
        return local_state(dmp), ck.last_restore_stats


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(storage, ckpt_id: int):
    """(report, table, entry, global rows stored) of every entry of checkpoint ``ckpt_id``."""
    from cnr_torchrec.ckpt.format.bytes.chunks import PayloadReader
    from cnr_torchrec.ckpt.format.commits import load_manifest
    from cnr_torchrec.ckpt.format.row_ids import decode_ids

    m = load_manifest(storage, ckpt_id)
    out = []
    for report, table, e in m.entries():
        load = PayloadReader(storage, report.payload, whole=False)
        ids = (decode_ids(e.ids.kind, load(e.ids.blob), e.num_rows) if e.ids is not None
               else torch.arange(e.num_rows))
        out.append((report, table, e, set((ids + e.rows[0]).tolist())))
    return m, out


def _payload_byte(storage, read: bool) -> tuple[str, int]:
    """A (chunk file, byte) inside the encoded rows of a row the newest restore reads (``read``) or of a
    baseline row that a delta stores again for the same columns, so that no restore reads it."""
    from cnr_torchrec.ckpt.format.commits import committed_ids

    ids = committed_ids(storage)
    tip, tip_rows = _rows(storage, ids[-1])
    if read:
        report, _, e, _ = next(x for x in tip_rows if x[2].ids is not None and x[2].checks)
        position = 0
    else:
        newer = [_rows(storage, i)[1] for i in ids[1:]]
        _, base_rows = _rows(storage, ids[0])
        found = None
        for report, table, e, stored in base_rows:
            if e.ids is not None or not e.checks:
                continue
            again = set().union(*(r for rows in newer for _, t, f, r in rows if t == table and f.cols == e.cols))
            size = e.checks.rows  # a whole check group that newer checkpoints store again is never read
            whole = [g for g in range(0, e.num_rows, size)
                     if all(e.rows[0] + i in again for i in range(g, min(e.num_rows, g + size)))]
            if whole:
                found, position = (report, e), whole[len(whole) // 2] + 1
                break
        if found is None:
            raise AssertionError("no group of baseline rows is stored again by the deltas")
        report, e = found
    blob = report.blobs[e.weights.blobs["payload"]]
    at = blob.offset + position * (blob.nbytes // e.num_stored)
    chunk = next(c for c in report.payload.chunks if c.start <= at < c.end)
    return chunk.path, at - chunk.start


def _flip(storage, path: str, at: int) -> None:
    data = bytearray(storage.read(path))
    data[at] ^= 0x10
    storage.write(path, bytes(data))


def _reseal(storage, file: str, data: bytes) -> None:
    """Writes ``data`` as payload ``file`` of the newest checkpoint with every xxh3 (its chunk's, its blobs',
    the manifest's) recomputed, as a crafted or buggy writer would leave it."""
    from cnr_torchrec.ckpt.format.bytes.payload import checksum
    from cnr_torchrec.ckpt.format.commits import committed_ids, manifest_path, seal

    storage.write_atomic(file, data)
    tip = committed_ids(storage)[-1]
    body = combined_body(storage, tip)
    for report in body["ranks"]:
        if report["file"] == file:  # one chunk: the toy payload is far below chunk_bytes
            report["chunks"][0]["xxh3"] = checksum(data)
            for meta in report["blobs"].values():
                meta["xxh3"] = checksum(data[meta["offset"] : meta["offset"] + meta["nbytes"]])
    write_combined(storage, tip, body)


def _damaged_chain(path: str, options: dict | None, read: bool):
    """A chain (:func:`_chain`) with one payload byte flipped (:func:`_payload_byte`); returns (dmp, opt, state
    after the last save, the chunk file flipped)."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    dmp, opt, want = _chain(path, options)
    storage = Storage(path, options)
    file, at = _payload_byte(storage, read=read)
    _flip(storage, file, at)
    storage.close()
    return dmp, opt, want, file


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        yield str(tmp_path / "ck"), None
        return
    pytest.importorskip("moto")
    server = R.Moto()
    try:
        yield f"s3://{server.bucket}/rows-{request.node.name}", server.options
    finally:
        server.close()


def test_a_restore_reads_the_newest_copy_of_each_row(group, root):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    path, options = root
    dmp, opt, want = _chain(path, options)
    got, stats = _restore(dmp, opt, path, options)
    assert _equal(got, want)
    storage = Storage(path, options)
    files = sum(storage.size(f) for i in (0, 1, 2, 3) for f in _rows(storage, i)[0].files)
    storage.close()
    # Less than the chain's files, more than the rows applied (their ids and the dense state come too).
    assert stats["minimal_bytes"] < stats["bytes_read"] < files, (stats, files)
    if options is None:  # the check groups under the rows, copied out of mapped files
        assert stats["bytes_read"] < 0.75 * files, (stats, files)  # 0.61 here; whole files: 1.0


def test_a_flip_in_a_row_that_is_read_is_named(group, root):
    from cnr_torchrec import CorruptCheckpointError

    path, options = root
    dmp, opt, _, file = _damaged_chain(path, options, read=True)
    with pytest.raises(CorruptCheckpointError, match="CRC-32C") as e:
        _restore(dmp, opt, path, options)
    assert e.value.path == file and file in str(e.value)


def test_a_flip_in_a_row_no_restore_reads_leaves_it_exact_and_verify_names_it(group, root):
    from cnr_torchrec.ckpt.tools.verify import verify_root

    path, options = root
    dmp, opt, want, file = _damaged_chain(path, options, read=False)
    got, _ = _restore(dmp, opt, path, options)
    assert _equal(got, want)
    problems = verify_root(path, storage_options=options) if options else verify_root(path)
    assert any(p.path == file for p in problems), [str(p) for p in problems]


def test_a_format_4_chain_without_row_crcs_is_read_whole(group, tmp_path):
    """A chain written before format 5 (no row checks; sealed as version 4) restores exactly, its chunks read
    whole."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, manifest_path, seal

    path = str(tmp_path / "ck")
    dmp, opt, want = _chain(path)
    storage = Storage(path)
    files = 0
    for i in committed_ids(storage):
        body = combined_body(storage, i)
        for report in body["ranks"]:
            files += report["nbytes"]
            for entries in report["tables"].values():
                for e in entries:
                    e.pop("checks")
        storage.write_atomic(manifest_path(i), seal(body, version=4))
    storage.close()
    got, stats = _restore(dmp, opt, path)
    assert _equal(got, want)
    assert stats["bytes_read"] >= files, (stats, files)  # every chunk of every file (and rank 0's dense blobs)


def test_offline_tables_read_around_rows_a_newer_checkpoint_stores(group, tmp_path):
    """``cnr export`` and ``cnr compact`` assemble tables as a restore reads: a flip in a superseded row changes
    nothing (once past verify, which names it), a flip in a row they use is named."""
    from cnr_torchrec import CorruptCheckpointError
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids
    from cnr_torchrec.ckpt.format.tables import assemble_tables
    from cnr_torchrec.ckpt.tools.checked_chain import load_chain

    path = str(tmp_path / "ck")
    _chain(path)
    storage = Storage(path)
    tip = committed_ids(storage)[-1]
    want = assemble_tables(storage, load_chain(storage, tip))
    file, at = _payload_byte(storage, read=False)
    _flip(storage, file, at)
    with pytest.raises(CorruptCheckpointError) as e:
        load_chain(storage, tip)
    assert e.value.path == file
    got = assemble_tables(storage, load_chain(storage, tip, verify=False))
    assert got.keys() == want.keys() and all(torch.equal(got[t].weights, want[t].weights) for t in want)
    assert all(torch.equal(a.values, b.values) for t in want for a, b in zip(got[t].states, want[t].states))
    file, at = _payload_byte(storage, read=True)
    _flip(storage, file, at)
    with pytest.raises(CorruptCheckpointError, match="CRC-32C"):
        assemble_tables(storage, load_chain(storage, tip, verify=False))
    storage.close()


def test_rows_that_differ_from_their_crcs_are_named_even_under_resealed_checksums(group, tmp_path):
    """A row changed and every xxh3 (chunk, blob, manifest) recomputed, as a crafted or buggy writer would
    leave it: the row's CRC-32C still catches it, in a restore and in verify_root."""
    from cnr_torchrec import CorruptCheckpointError
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.verify import verify_root

    path = str(tmp_path / "ck")
    dmp, opt, _ = _chain(path)
    storage = Storage(path)
    file, at = _payload_byte(storage, read=True)
    _flip(storage, file, at)
    _reseal(storage, file, bytes(storage.read(file)))
    storage.close()
    problems = [str(p) for p in verify_root(path)]
    assert any(file in p and "do not match their CRC-32C" in p for p in problems), problems
    with pytest.raises(CorruptCheckpointError, match="CRC-32C") as e:
        _restore(dmp, opt, path)
    assert e.value.path == file


@pytest.mark.parametrize("flip", [False, True])
def test_groups_cut_by_a_chunks_end_are_checked(group, tmp_path, flip):
    """Payloads in 4 KiB chunks, so that rows and check groups straddle chunk ends: the restore is exact, and
    a flipped first byte of a chunk that holds rows of the tip's entries is named."""
    from cnr_torchrec import CorruptCheckpointError
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

    path = str(tmp_path / "ck")
    dmp, opt, want = _chain(path, chunk_bytes=4096)
    if not flip:
        got, _ = _restore(dmp, opt, path, chunk_bytes=4096)
        assert _equal(got, want)
        return
    storage = Storage(path)
    tip = load_manifest(storage, committed_ids(storage)[-1])
    cuts = []
    for report, _, e in tip.entries():
        for name in e.row_blobs:
            blob = report.blobs[name]
            cuts += [(c.path, c.start) for c in report.payload.chunks[1:] if blob.offset < c.start < blob.end
                     and (c.start - blob.offset) % (blob.nbytes // e.num_stored)]  # a row cut by the chunk's end
    assert cuts, "no row straddles a chunk's end"
    file, _ = cuts[len(cuts) // 2]
    _flip(storage, file, 0)
    storage.close()
    with pytest.raises(CorruptCheckpointError, match="CRC-32C"):
        _restore(dmp, opt, path, chunk_bytes=4096)


def test_ids_that_disagree_with_their_count_are_named_by_every_reader(group, tmp_path):
    """A bit of an entry's id bitmap flipped and every xxh3 recomputed: a restore, ``cnr export``'s assembly
    and verify_root each name the file; none applies rows by the wrong ids."""
    from cnr_torchrec import CorruptCheckpointError
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, manifest_path
    from cnr_torchrec.ckpt.format.tables import assemble_tables
    from cnr_torchrec.ckpt.tools.checked_chain import load_chain
    from cnr_torchrec.ckpt.tools.verify import verify_root

    path = str(tmp_path / "ck")
    dmp, opt, _ = _chain(path)
    storage = Storage(path)
    tip = committed_ids(storage)[-1]
    body = combined_body(storage, tip)
    report = body["ranks"][0]
    file = report["file"]
    ids = next(e["ids"] for entries in report["tables"].values() for e in entries
               if e.get("ids") and e["ids"]["kind"] == "bitmap")
    data = bytearray(storage.read(file))
    data[report["blobs"][ids["blob"]]["offset"]] ^= 0x01  # one more or one fewer stored row
    _reseal(storage, file, bytes(data))
    problems = [str(p) for p in verify_root(path)]
    assert any(file in p and "row ids do not match" in p for p in problems), problems
    with pytest.raises(CorruptCheckpointError, match="row ids do not match") as e:
        assemble_tables(storage, load_chain(storage, tip, verify=False))
    assert e.value.path == file
    storage.close()
    with pytest.raises(CorruptCheckpointError, match="row ids do not match") as e:
        _restore(dmp, opt, path)
    assert e.value.path == file


# ---- decode threads ---------------------------------------------------------------------------

def test_a_restore_decodes_on_its_threads_and_gives_them_back(group, tmp_path, monkeypatch):
    """``restore_threads: 2`` under a one-thread pool (as torchrun leaves a rank): every entry is decoded on 2
    intra-op threads, the restore is exact, and the pool is back at 1 thread afterwards."""
    from cnr_torchrec.ckpt.restore.apply import Applier

    path = str(tmp_path / "ck")
    dmp, opt, want = _chain(path)
    seen = []
    apply = Applier.apply

    def counting(self, plan, rows):
        seen.append(torch.get_num_threads())
        return apply(self, plan, rows)

    monkeypatch.setattr(Applier, "apply", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got, _ = _restore(dmp, opt, path, restore_threads=2)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert _equal(got, want)
    assert seen and set(seen) == {2}, seen
    assert after == 1


def test_decode_threads_is_the_ranks_share_of_the_cores(monkeypatch):
    """The rank's share: what the config says; the cores it is pinned to; else the machine's cores over the
    node's ranks, at least one."""
    import cnr_torchrec.ckpt.restore.threads as T

    monkeypatch.setattr(T.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert T.decode_threads() == 4
    assert T.decode_threads(3) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert T.decode_threads() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert T.decode_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    assert T.decode_threads() == 6  # pinned by the launcher: its split stands


def test_restore_threads_out_of_range_is_refused():
    from cnr_torchrec import ConfigError, load_config

    with pytest.raises(ConfigError, match="restore_threads"):
        load_config({"root": "/x", "restore_threads": 0})
