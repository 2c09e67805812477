"""Sealed manifests and the committed index (format/commits.py): seal and load, edits and flipped digits
caught, truncated or foreign manifests refused by name, older versions read, committed ids on listing and
non-listing backends."""

from __future__ import annotations

import json

import pytest
from _format_checks import xxh3_reference

from cnr_torchrec.ckpt.format.commits import (
    INDEX,
    ckpt_dir,
    committed_ids,
    load_manifest,
    manifest_path,
    rank_file,
    read_body,
    seal,
    write_index,
)
from cnr_torchrec.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
)

BODY = {"id": 3, "step": 12345, "kind": "delta", "base": 0, "depth": 2, "parent": 2, "since": "previous",
        "encodings": {"t": "rows"}, "nbytes": 4096, "lr": 0.015625, "reason": "policy consecutive"}


def test_a_version_2_manifest_gets_the_links_its_chain_list_gave(storage):
    old = {k: v for k, v in BODY.items() if k not in ("base", "depth")} | {"chain": [0, 2, 3]}
    storage.write(manifest_path(3), seal(old, version=2))
    assert read_body(storage, 3) == old | {"base": 0, "depth": 2}


def test_manifest_paths():
    assert ckpt_dir(3) == "ckpt-00000003"
    assert manifest_path(12) == "ckpt-00000012/manifest.json"
    assert rank_file(7, 2) == "ckpt-00000007/rank-00002.bin"


def test_seal_and_load(storage):
    raw = seal(BODY)
    doc = json.loads(raw)
    assert doc["format"] == "cnr-checkpoint" and doc["version"] == 7 and doc["body"] == BODY
    # The checksum covers the body's text as it stands in the file, between '"body": ' and the closing brace.
    text = raw[raw.index(b'"body": ') + len(b'"body": ') : raw.rindex(b"}")]
    assert json.loads(text) == BODY
    assert doc["xxh3"] == xxh3_reference(text)
    assert list(doc) == ["format", "version", "xxh3", "body"]
    storage.write(manifest_path(3), raw)
    assert read_body(storage, 3) == BODY


@pytest.mark.parametrize("old,new", [
    (b'"step":12345', b'"step":12346'),
    (b'"lr":0.015625', b'"lr":0.015624'),
    (b'"delta"', b'"delte"'),
    (b'"parent":2', b'"parent":3'),
    (b'"depth":2', b'"depth":1'),
    (b'"id":3,', b'"id":3 ,'),  # whitespace: the checksum covers the text as written
])
def test_manifest_edit_that_still_parses_is_caught(storage, old, new):
    raw = seal(BODY)
    assert raw.count(old) == 1
    bad = raw.replace(old, new)
    json.loads(bad)  # still valid JSON
    storage.write(manifest_path(3), bad)
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum") as e:
        load_manifest(storage, 3)
    assert e.value.path == manifest_path(3) and manifest_path(3) in str(e.value)


def test_manifest_with_a_flipped_checksum_digit(storage):
    doc = json.loads(seal(BODY))
    doc["xxh3"] = ("0" if doc["xxh3"][0] != "0" else "1") + doc["xxh3"][1:]
    storage.write(manifest_path(3), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load_manifest(storage, 3)


@pytest.mark.parametrize("cut", [1, 10, 100])
def test_truncated_manifest(storage, cut):
    raw = seal(BODY)
    storage.write(manifest_path(3), raw[:-cut])
    with pytest.raises(CorruptCheckpointError, match="is not valid JSON") as e:
        load_manifest(storage, 3)
    assert e.value.path == manifest_path(3) and manifest_path(3) in str(e.value)


def test_manifest_that_is_not_utf8(storage):
    storage.write(manifest_path(3), b"\xff\xfe\x00garbage")
    with pytest.raises(CorruptCheckpointError) as e:
        load_manifest(storage, 3)
    assert e.value.path == manifest_path(3)


def test_manifest_of_another_checkpoint(storage):
    storage.write(manifest_path(4), seal(BODY))
    with pytest.raises(CorruptCheckpointError, match="describes checkpoint 3, not 4") as e:
        load_manifest(storage, 4)
    assert e.value.path == manifest_path(4)


@pytest.mark.parametrize("doc", [[1, 2], {"format": "other", "version": 1, "body": {}}, {"format": "cnr-checkpoint"}])
def test_not_a_manifest(storage, doc):
    storage.write(manifest_path(3), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="not a cnr_torchrec manifest"):
        load_manifest(storage, 3)


@pytest.mark.parametrize("version", [1, 8, 0, None, "2"])
def test_manifest_version_mismatch(storage, version):
    doc = json.loads(seal(BODY))
    doc["version"] = version
    storage.write(manifest_path(3), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError) as e:
        load_manifest(storage, 3)
    assert f"format version {version!r}" in str(e.value) and "reads versions 2 to 7" in str(e.value)
    assert ("earlier cnr_torchrec" if version == 1 else "upgrade cnr_torchrec") in str(e.value)
    assert e.value.path == manifest_path(3)


@pytest.mark.parametrize("version", [3, 4, 5, 6])
def test_older_manifests_still_load(storage, version):
    storage.write(manifest_path(3), seal(BODY, version=version))
    assert read_body(storage, 3) == BODY


def test_missing_manifest(storage):
    with pytest.raises(CheckpointNotFoundError, match=r"ckpt-00000005/manifest.json does not exist"):
        load_manifest(storage, 5)


def _commit(storage, *ids):
    for i in ids:
        storage.write(manifest_path(i), seal({"id": i}))


def test_committed_ids_on_a_listing_backend(storage):
    _commit(storage, 0, 2, 11)
    storage.write(rank_file(1, 0), b"payload of a save that never committed")
    storage.write("ckpt-12/manifest.json", b"{}")  # not an id directory
    storage.write("other/manifest.json", b"{}")
    storage.write("ckpt-00000005", b"a file, not a directory")
    assert committed_ids(storage) == [0, 2, 11]


def test_committed_ids_on_a_non_listing_backend(storage):
    _commit(storage, 0, 1, 2)
    storage.local_dir = None
    assert committed_ids(storage) == [0, 1, 2]  # no index: scan from 0


def test_committed_ids_non_listing_uses_the_index(storage):
    _commit(storage, 3, 4, 6, 7, 8, 1)
    write_index(storage, [3, 4, 5, 6])  # 5 was collected after the index was written; 7, 8 are newer
    storage.local_dir = None
    assert committed_ids(storage) == [3, 4, 6, 7, 8]  # 1 is not in the index: invisible without listing
    storage.delete(manifest_path(8))
    storage.delete(manifest_path(7))
    assert committed_ids(storage) == [3, 4, 6]


def test_write_index_is_sorted_json(storage, tmp_path):
    write_index(storage, [5, 1, 3])
    assert json.loads((tmp_path / "root" / INDEX).read_bytes()) == {"format": "cnr-index", "committed": [1, 3, 5]}


@pytest.mark.parametrize("text", [b"not json", b"[1, 2]", b'{"committed": ["x"]}', b'{"committed": 5}'])
def test_corrupt_index(storage, text):
    _commit(storage, 0)
    storage.write(INDEX, text)
    storage.local_dir = None
    with pytest.raises(CorruptCheckpointError, match="index.json is corrupt") as e:
        committed_ids(storage)
    assert e.value.path == INDEX


def test_corrupt_index_on_a_non_listing_backend_says_how_to_repair_it(storage):
    """Without listing, the index is the only catalog once garbage collection has made gaps:
    the error says to rewrite it (deleting it would hide checkpoints 3..5), and a rewritten
    index finds them again."""
    _commit(storage, 3, 4, 5)
    storage.write(INDEX, b"not json")
    storage.local_dir = None
    with pytest.raises(CorruptCheckpointError, match="rewrite it") as e:
        committed_ids(storage)
    assert "delete" not in str(e.value) and e.value.path == INDEX
    write_index(storage, [3, 4, 5])
    assert committed_ids(storage) == [3, 4, 5]
