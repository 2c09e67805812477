"""The root's storage (format/bytes/storage.py): XXH3-128 checksums, paths kept inside the root, atomic writes,
listing and removal, fs:// and plain paths, and backends that cannot list."""

from __future__ import annotations

import os

import pytest
from _format_checks import xxh3_reference

from cnr_torchrec.ckpt.format.bytes.storage import Storage, check_relative, checksum
from cnr_torchrec.errors import (
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)


def test_checksum_is_xxh3_128():
    # Published XXH3-128 value of the empty input (xxhash's test vectors).
    assert checksum(b"") == "99aa06d3014798d86001c324468d497f"
    data = bytearray(range(256)) * 1000
    assert checksum(data) == checksum(memoryview(data)) == checksum(bytes(data)) == xxh3_reference(data)
    data[12345] ^= 1
    assert checksum(data) != xxh3_reference(bytes(range(256)) * 1000)


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../../b", "..", "", "\\x", "./../x", "a/b/../../../c"])
def test_paths_escaping_the_root_are_rejected(path, storage):
    with pytest.raises(UnsafeCheckpointError, match="escapes the checkpoint root"):
        check_relative(path)
    for call in (lambda: storage.read(path), lambda: storage.write(path, b"x"), lambda: storage.exists(path),
                 lambda: storage.delete(path), lambda: storage.write_atomic(path, b"x")):
        with pytest.raises(UnsafeCheckpointError):
            call()


@pytest.mark.parametrize("path,norm", [("a/b", "a/b"), ("a/./b", "a/b"), ("a/../b", "b"), ("a//b/", "a/b"),
                                       ("..a", "..a")])
def test_paths_inside_the_root_are_normalized(path, norm):
    assert check_relative(path) == norm


def test_write_read_exists_delete(storage, tmp_path):
    storage.write("d/f.bin", b"0123456789")
    assert (tmp_path / "root" / "d" / "f.bin").read_bytes() == b"0123456789"
    whole = storage.read("d/f.bin")
    assert whole == b"0123456789" and isinstance(whole, bytearray)  # local whole reads are writable, not copied
    big = bytes(range(256)) * 40_000  # several read() calls' worth
    storage.write("d/big.bin", big)
    assert storage.read("d/big.bin") == big
    assert storage.read("d/f.bin", byte_range=(3, 7)) == b"3456"
    assert storage.read("d/f.bin", byte_range=(8, 20)) == b"89"
    assert storage.exists("d/f.bin") and not storage.exists("d/g.bin") and not storage.exists("d")
    storage.delete("d/f.bin")
    storage.delete("d/f.bin")  # already gone: fine
    assert not storage.exists("d/f.bin")


def test_read_missing_file(storage):
    with pytest.raises(CheckpointNotFoundError, match="nope.bin does not exist"):
        storage.read("ckpt-00000001/nope.bin")
    with pytest.raises(FileNotFoundError):
        storage.read("nope.bin", byte_range=(0, 1))


def test_write_atomic_replaces_and_leaves_no_temp_file(storage, tmp_path):
    storage.write_atomic("c/manifest.json", b"first version, longer")
    storage.write_atomic("c/manifest.json", b"second")
    assert (tmp_path / "root" / "c" / "manifest.json").read_bytes() == b"second"
    assert os.listdir(tmp_path / "root" / "c") == ["manifest.json"]
    assert storage.read("c/manifest.json") == b"second"
    storage.fsync_file("c/manifest.json")


def test_list_and_remove_dirs(tmp_path):
    s = Storage(str(tmp_path / "not-yet"))
    try:
        assert s.list_dirs() == []
        for f in ("b/x.bin", "a/y.bin", "a/sub/z.bin", "top.bin"):
            s.write(f, b"1")
        assert s.list_dirs() == ["a", "b"]
        s.remove_dir("a", ["a/y.bin"])
        assert s.list_dirs() == ["b"] and not (tmp_path / "not-yet" / "a").exists()
    finally:
        s.close()


@pytest.mark.parametrize("uri,local", [("fs://{}", True), ("{}", True)])
def test_fs_uri_is_local(uri, local, tmp_path):
    s = Storage(uri.format(tmp_path))
    try:
        assert s.local_dir == str(tmp_path)
        s.write("k.bin", b"v")
        assert (tmp_path / "k.bin").read_bytes() == b"v"
    finally:
        s.close()


def test_non_listing_backend_reads_through_the_plugin(storage):
    storage.write("d/f.bin", b"abc")
    storage.local_dir = None
    assert storage.list_dirs() is None
    assert storage.exists("d/f.bin") and not storage.exists("d/missing.bin")
    storage.write_atomic("d/g.bin", b"xyz")  # a single PUT
    assert storage.read("d/g.bin") == b"xyz"
