"""Authenticated roots (``integrity``): what someone without the key writes or alters is refused by name.

The toy model over every sharding type saves a baseline and a delta under a key. Then, as someone
who can write to the root but does not hold the key would:

- every field of the delta's manifest is mutated (the mutation suite of test_manifest_schema.py) and
  re-sealed with fresh xxh3, without a key and with another key;
- a stored row is rewritten with fresh CRC-32Cs and fresh xxh3 (chunk, blobs, manifest): the same
  rewrite restores silently on a root without a key, which is the attack a key stops;
- the chunk alone is rewritten, the manifest untouched.

Each is refused by restore (under on_corrupt: fallback too, for a manifest), by ``cnr verify
--key-file`` and by ``cnr export``. A keyed root read without its key, with another key, and an
unkeyed root read with a key are refused by name; the keyed root restores what was saved, bit for bit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from _format_checks import combined_body, write_combined
from _toy import build_dmp, local_state, train
from test_manifest_schema import PLAN, _fields, _mutations, _Reader, _set

KEY = b"0123456789abcdef0123456789abcdef"
OTHER = b"fedcba9876543210fedcba9876543210"


def _key_file(tmp_path, secret: bytes, name: str = "key") -> str:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(secret + b"\n")
    os.chmod(path, 0o600)
    return path


def _checkpointer(root, seed, key_file=None, on_corrupt="fail"):
    from cnr_torchrec import Checkpointer, load_config
    from examples.toy import TableSpec

    specs = [TableSpec(f"t{i}", 120, 8, st, "ebc") for i, st in enumerate(PLAN)]
    dmp, opt = build_dmp(specs, seed=seed)
    cfg = load_config({"root": root, "policy": "consecutive", "on_corrupt": on_corrupt,
                       "quantization": {"method": "adaptive", "bits": 4}, "chunk_bytes": 4096,
                       "integrity": {"key_file": key_file}})
    return Checkpointer(dmp, cfg, dense_optimizer=opt, extra_state={"reader": _Reader()}), dmp, specs, opt


def _saved(root, key_file):
    """A baseline and a delta of a seeded training run under ``root``; returns the delta's manifest path."""
    from cnr_torchrec.ckpt.format.commits import manifest_path

    ck, dmp, specs, opt = _checkpointer(root, 0, key_file)
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2):
        train(dmp, specs, opt, 2, gen)
        info = ck.save(step).wait()
    ck.close()
    return os.path.join(root, manifest_path(info.id))


def _restored(root, key_file) -> dict:
    """What a fresh model holds after restoring the newest checkpoint of ``root``."""
    ck, dmp, *_ = _checkpointer(root, 1, key_file)
    assert ck.restore() == 2
    ck.close()
    return local_state(dmp)


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _verify(root, key_file):
    from cnr_torchrec.ckpt.format.bytes.integrity import load_key
    from cnr_torchrec.ckpt.tools.verify import verify_root

    return verify_root(root, key=load_key(key_file, None))


@pytest.fixture
def keyed(group, tmp_path):
    """A keyed root: (root, key file, what its restore gives, the delta's manifest path)."""
    root, key_file = str(tmp_path / "root"), _key_file(tmp_path, KEY)
    manifest = _saved(root, key_file)
    return root, key_file, _restored(root, key_file), manifest


def test_a_keyed_root_restores_what_it_saved_and_seals_every_manifest_and_chunk(keyed, tmp_path):
    """The same seeded run saved without a key restores the same bits: the key changes the checks only."""
    from cnr_torchrec import UnauthenticatedCheckpointError

    from cnr_torchrec.ckpt.format.bytes.integrity import load_key
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root, key_file, want, manifest = keyed
    doc = json.loads(open(manifest, "rb").read())
    assert len(doc["hmac_sha256"]) == 64
    assert all(set(line) & {"xxh3", "blake2b"} == {"blake2b"} for line in doc["body"]["parts"])
    storage = Storage(root, key=load_key(key_file, None))
    chunks = [c for r in combined_body(storage, 1)["ranks"] for c in r["chunks"]]
    storage.close()
    assert chunks and all(set(c) == {"nbytes", "blake2b"} for c in chunks)
    plain = str(tmp_path / "plain")
    _saved(plain, None)
    assert _equal(_restored(plain, None), want)
    assert _verify(root, key_file) == []
    # Without the key, and with another one: refused by name, under fallback too (never an older checkpoint).
    for other, on_corrupt in ((None, "fallback"), (_key_file(tmp_path, OTHER, "other"), "fallback")):
        ck, dmp, *_ = _checkpointer(root, 1, other, on_corrupt)
        before = local_state(dmp)
        with pytest.raises(UnauthenticatedCheckpointError, match=r"ckpt-00000001/manifest\.json") as e:
            ck.restore()
        assert ("integrity.key_file" in str(e.value)) if other is None else ("another key" in str(e.value))
        assert _equal(local_state(dmp), before)
        ck.close()
        problems = _verify(root, other)
        assert problems and all("manifest.json" in p.path for p in problems), problems


def test_a_root_without_a_key_is_refused_by_a_reader_that_holds_one(group, tmp_path):
    from cnr_torchrec import UnauthenticatedCheckpointError

    root = str(tmp_path / "root")
    _saved(root, None)
    ck, *_ = _checkpointer(root, 1, _key_file(tmp_path, KEY))
    with pytest.raises(UnauthenticatedCheckpointError, match="written without a key"):
        ck.restore()
    ck.close()


def test_every_crafted_manifest_of_a_keyed_root_is_refused_by_name(keyed, tmp_path):
    """The mutation suite's fields of a real delta (its index, and its parts as one body), each mutated every way
    and written back by someone without the key (fresh xxh3, no MAC) or with another key (digests and a MAC that
    do not verify): every one refused by name."""
    import shutil

    from cnr_torchrec import UnauthenticatedCheckpointError
    from cnr_torchrec.ckpt.format.bytes.integrity import RootKey, load_key
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import read_body, seal

    root, key_file, want, manifest = keyed
    pristine = str(tmp_path / "pristine")
    shutil.copytree(os.path.dirname(manifest), pristine)
    storage = Storage(root, key=load_key(key_file, None))
    body, index = combined_body(storage, 1), read_body(storage, 1)
    restorer, dmp, *_ = _checkpointer(root, 1, key_file, on_corrupt="fallback")
    forger = RootKey(OTHER, "the forger's key")
    cases = [("parts", f, how, new) for f, value in _fields(index) if f[0] == "parts" for how, new in
             _mutations(value)]
    cases += [("body", f, how, new) for f, value in _fields(body) for how, new in _mutations(value)]
    cases.append(("body", (), "untouched", None))  # as the key sealed it, written back without the key
    refused = []
    for i, (what, field, how, new) in enumerate(cases):
        mutated = json.loads(json.dumps(index if what == "parts" else body))
        if field:
            _set(mutated, field, how, new)
        signer = forger if i % 2 else None
        if what == "parts":
            storage.write_atomic("ckpt-00000001/manifest.json", seal(mutated, key=signer))
        else:
            write_combined(storage, 1, mutated, key=signer)
        with pytest.raises(UnauthenticatedCheckpointError) as e:
            restorer.restore()
        assert e.value.path == "ckpt-00000001/manifest.json", (field, how, str(e.value))
        refused.append((field, how))
        if i % 16 == 0:  # verify is slower: a sample of both forgers
            assert any(p.path == "ckpt-00000001/manifest.json" and "hmac_sha256" in p.message
                       for p in _verify(root, key_file)), (field, how)
    print(f"crafted manifests refused: {len(refused)} of {len(cases)}")  # shown with -s
    assert len(refused) == len(cases) >= 32
    storage.close()
    shutil.rmtree(os.path.dirname(manifest))
    shutil.copytree(pristine, os.path.dirname(manifest))
    assert restorer.restore() == 2 and _equal(local_state(dmp), want)
    restorer.close()


def _rewrite_a_row(root, key, forger):
    """Changes a stored row of the delta's first entry with CRC-32Cs, and recomputes what covers it: the CRC
    group, the blobs' xxh3, the chunk's digest and the manifest's seal, as ``forger`` can: ``"no key"`` (xxh3
    chunks, no MAC), a RootKey (its keyed digest and MAC), or ``"chunk only"`` (the manifest left alone).
    Returns the paths of the chunks changed, the table, and the rank report and entry of the row."""
    from cnr_torchrec.ckpt.format.bytes.integrity import chunk_hasher, chunk_record
    from cnr_torchrec.ckpt.format.bytes.payload import checksum
    from cnr_torchrec.ckpt.format.bytes.rows import as_rows
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import load_manifest
    from cnr_torchrec.ops import row_crc32c

    storage = Storage(root, key=key)
    report, table, e = next((r, t, e) for r, t, e in load_manifest(storage, 1).entries()
                            if e.checks is not None and e.num_stored > 1)
    chunks = report.payload.chunks  # 4 KiB each: the rewrite spares the chunks other blobs are read from
    data = bytearray(b"".join(storage.read(c.path) for c in chunks))
    before = bytes(data)
    blobs = report.payload.blobs

    def view(name):
        b = blobs[name]
        return torch.frombuffer(data, dtype=torch.uint8, count=b.nbytes, offset=b.offset)

    first = e.row_blobs[0]
    rows = as_rows(view(first).view(getattr(torch, blobs[first].dtype)).reshape(blobs[first].shape))
    rows[-1] ^= 0x10  # the last stored row, in place
    parts = [view(n).reshape(e.num_stored, -1) for n in e.row_blobs]
    view(e.row_checks.blob).copy_(row_crc32c(parts, e.row_checks.rows).view(torch.uint8).reshape(-1))
    changed = [k for k, c in enumerate(chunks) if data[c.start : c.end] != before[c.start : c.end]]
    for k in changed:
        storage.write_atomic(chunks[k].path, bytes(data[chunks[k].start : chunks[k].end]))
    if forger != "chunk only":
        body = combined_body(storage, 1)
        raw = next(r for r in body["ranks"] if r["rank"] == report.rank)
        for name in (first, e.row_checks.blob):
            b = blobs[name]
            raw["blobs"][name]["xxh3"] = checksum(bytes(data[b.offset : b.end]))
        signer = None if forger == "no key" else forger
        for k, c in enumerate(chunks):  # an unkeyed forger lists every chunk with xxh3, as a root without a key
            if k in changed or signer is None:
                hasher = chunk_hasher(signer)
                hasher.update(data[c.start : c.end])
                raw["chunks"][k] = chunk_record(signer, c.nbytes, hasher.hexdigest())
        write_combined(storage, 1, body, key=signer)
    storage.close()
    return [chunks[k].path for k in changed], table, report, e


def test_a_rewritten_row_restores_silently_without_a_key(group, tmp_path):
    """The attack itself: on a root without a key, the rewritten row passes every check and is restored."""
    root = str(tmp_path / "root")
    _saved(root, None)
    want = _restored(root, None)
    _, table, _, _ = _rewrite_a_row(root, None, "no key")
    got = _restored(root, None)
    assert _verify(root, None) == []
    assert [k for k in want if not torch.equal(got[k], want[k])] == [(table, 0, "w")]


@pytest.mark.parametrize("forger", ["no key", "another key", "chunk only"])
def test_a_rewritten_row_of_a_keyed_root_is_refused_by_name(keyed, forger):
    from cnr_torchrec import CorruptCheckpointError, UnauthenticatedCheckpointError
    from cnr_torchrec.ckpt.format.bytes.integrity import RootKey, load_key
    from cnr_torchrec.ckpt.format.bytes.rows import RowReader
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root, key_file, want, manifest = keyed
    key = load_key(key_file, None)
    forged = RootKey(OTHER, "the forger's key") if forger == "another key" else forger
    changed, _, report, entry = _rewrite_a_row(root, key, forged)
    ck, dmp, *_ = _checkpointer(root, 1, key_file)
    if forger == "chunk only":
        with pytest.raises(CorruptCheckpointError, match=r"does not match its keyed blake2b") as e:
            ck.restore()
        assert e.value.path in changed
        # The entry's own rows, by the reader a partial recovery uses: the CRC-32Cs match, the chunk does not.
        storage = Storage(root, key=key)
        with pytest.raises(CorruptCheckpointError, match=r"does not match its keyed blake2b") as e:
            RowReader(storage, report.payload).rows(entry, torch.arange(entry.num_stored))
        storage.close()
        assert e.value.path in changed
        problems = _verify(root, key_file)
        assert {p.path for p in problems if "keyed blake2b" in p.message} == set(changed), problems
    else:
        with pytest.raises(UnauthenticatedCheckpointError) as e:
            ck.restore()
        assert e.value.path == "ckpt-00000001/manifest.json", str(e.value)
    ck.close()
    # Under fallback a damaged chunk (which a key cannot tell from an accident) gives the older checkpoint.
    ck, dmp, *_ = _checkpointer(root, 1, key_file, on_corrupt="fallback")
    if forger == "chunk only":
        assert ck.restore() == 1
    else:
        with pytest.raises(UnauthenticatedCheckpointError):
            ck.restore()
    ck.close()


def test_the_cnr_command_takes_the_key(keyed, tmp_path, capsys):
    from cnr_torchrec.cli import main

    root, key_file, _, manifest = keyed
    assert main(["verify", root, "--key-file", key_file]) == 0
    assert main(["verify", root]) == 1
    assert "sealed with a key" in capsys.readouterr().out
    out = str(tmp_path / "state.pt")
    assert main(["export", root, "--out", out, "--key-file", key_file]) == 0
    assert os.path.getsize(out) > 0
    assert main(["export", root, "--out", str(tmp_path / "x.pt")]) == 2
    assert "UnauthenticatedCheckpointError" in capsys.readouterr().err


@pytest.mark.multirank
def test_ranks_with_different_keys_are_refused_on_every_rank(tmp_path):
    from _dist import run_ranks

    run_ranks(_two_keys_worker, 2, timeout=120, args=(str(tmp_path),))


def _two_keys_worker(rank, world_size, tmp):
    import pathlib

    from cnr_torchrec import ConfigError

    key_file = _key_file(pathlib.Path(tmp), KEY if rank == 0 else OTHER, f"key{rank}")
    with pytest.raises(ConfigError, match="the ranks hold different keys"):
        _checkpointer(os.path.join(tmp, "root"), 0, key_file)


@pytest.mark.parametrize("mac", ["", "truncated"])
def test_an_empty_or_truncated_mac_is_refused_by_restore_and_verify(keyed, mac):
    """A MAC compared over the stored digest's length alone would take an empty one (or its first bytes) as a
    match: the whole HMAC-SHA256 must agree."""
    from cnr_torchrec import UnauthenticatedCheckpointError

    root, key_file, _, manifest = keyed
    raw = open(manifest, "rb").read()
    stored = json.loads(raw)["hmac_sha256"]
    forged = stored[:8] if mac == "truncated" else ""
    with open(manifest, "wb") as f:  # the header's MAC alone changed: the body and its xxh3 are as written
        f.write(raw.replace(f'"hmac_sha256": "{stored}"'.encode(), f'"hmac_sha256": "{forged}"'.encode(), 1))
    assert json.loads(open(manifest, "rb").read())["hmac_sha256"] == forged
    restorer, *_ = _checkpointer(root, 1, key_file)
    with pytest.raises(UnauthenticatedCheckpointError, match="does not match its hmac_sha256"):
        restorer.restore()
    restorer.close()
    assert any("hmac_sha256" in p.message for p in _verify(root, key_file))


@pytest.mark.parametrize("command", ["compact", "export-dcp"])
def test_compaction_and_dcp_export_of_a_keyed_root_read_whole_chunks_only(keyed, tmp_path, monkeypatch, command):
    """On a keyed root only a whole chunk's keyed digest vouches for its bytes: every payload read of `cnr compact`
    and `cnr export --format dcp` is of whole chunks, never a range checked by an xxh3 the key does not cover."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.cli import main

    root, key_file, _, _ = keyed
    reads = []
    read = Storage.read

    def recorded(self, path, byte_range=None):
        reads.append((path, byte_range))
        return read(self, path, byte_range)

    monkeypatch.setattr(Storage, "read", recorded)
    argv = (["compact", root] if command == "compact" else
            ["export", "--format", "dcp", root, "--out", str(tmp_path / "dcp")])
    assert main([*argv, "--key-file", key_file]) == 0
    payload = [(p, r) for p, r in reads if p.endswith(".bin")]
    assert payload and all(r is None for _, r in payload), [x for x in payload if x[1] is not None][:3]
    assert {p for p, _ in payload} >= {"ckpt-00000001/rank-00000.bin"}  # the tip's chunk was read, whole


def test_cnr_copy_of_a_keyed_root_checks_each_chunk_under_the_key_and_restores_the_same(keyed, tmp_path, capsys):
    from cnr_torchrec.cli import main

    root, key_file, want, _ = keyed
    dst = str(tmp_path / "copy")
    assert main(["copy", root, dst]) == 2  # without the key: refused, nothing vouched for
    assert "sealed with a key" in capsys.readouterr().err
    assert main(["copy", root, dst, "--key-file", key_file]) == 0, capsys.readouterr().err
    assert _verify(dst, key_file) == []
    assert _equal(_restored(dst, key_file), want)
