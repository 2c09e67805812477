"""Checkpoints on S3: the storage layer and 2-rank round trips and kills against a local moto server.

moto runs in a subprocess (benchmarks/reliability.py ``Moto``) so that no server thread
lives in the process that forks the ranks. Endpoint and credentials reach the ranks
through ``storage_options`` (and, in one test, through the AWS_* environment variables
that botocore reads), never through a real AWS account.
"""

from __future__ import annotations

import os
import sys

import pytest

from cnr_torchrec.ckpt.format.bytes.plugins import S3Plugin
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import committed_ids, existing_dir_ids, manifest_path, seal
from cnr_torchrec.errors import CheckpointNotFoundError, ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import reliability as R  # noqa: E402

pytest.importorskip("moto")


@pytest.fixture(scope="module")
def moto():
    server = R.Moto()
    yield server
    server.close()


@pytest.fixture
def s3(moto, request):
    root = f"s3://{moto.bucket}/units/{request.node.name}"
    storage = Storage(root, moto.options)
    yield storage, moto, root.split("/", 3)[3]
    storage.close()


def test_s3_files_listing_sizes_and_prefix_removal(s3):
    storage, moto, prefix = s3
    assert isinstance(storage._plugin, S3Plugin) and storage.can_list and storage.local_dir is None
    assert storage.list_dirs() == []
    storage.write("ckpt-00000001/rank-00000.bin", b"0123456789")
    storage.write("ckpt-00000001/rank-00001.bin", b"")
    storage.write("ckpt-00000002/rank-00000.bin", b"x")
    storage.write("ckpt-00000002/sub/deeper.bin", b"y")
    storage.write_atomic("index.json", b"{}")
    assert storage.list_dirs() == ["ckpt-00000001", "ckpt-00000002"]
    assert storage.read("ckpt-00000001/rank-00000.bin", byte_range=(3, 7)) == b"3456"
    assert storage.read("ckpt-00000001/rank-00000.bin", byte_range=(8, 20)) == b"89"
    assert storage.read("ckpt-00000001/rank-00000.bin", byte_range=(12, 20)) == b""  # past the end: a short read
    assert storage.size("ckpt-00000001/rank-00000.bin") == 10 and storage.size("ckpt-00000001/rank-00001.bin") == 0
    assert storage.exists("ckpt-00000001/rank-00001.bin") and not storage.exists("ckpt-00000001/nope.bin")
    with pytest.raises(CheckpointNotFoundError, match="nope.bin does not exist") as e:
        storage.read("ckpt-00000001/nope.bin")
    assert e.value.path == "ckpt-00000001/nope.bin"
    with pytest.raises(CheckpointNotFoundError):
        storage.size("ckpt-00000001/nope.bin")
    storage.delete("ckpt-00000001/nope.bin")  # already gone: fine
    # remove_dir takes the named files and then everything else under the prefix, nested objects too.
    storage.remove_dir("ckpt-00000002", ["ckpt-00000002/rank-00000.bin"])
    assert storage.list_dirs() == ["ckpt-00000001"]
    assert moto.keys(prefix + "/") == sorted(f"{prefix}/{k}" for k in ("ckpt-00000001/rank-00000.bin",
                                                                       "ckpt-00000001/rank-00001.bin", "index.json"))


def test_s3_catalog_uses_listing_not_the_index(s3):
    """Committed = a manifest exists; the index is not needed (a stale or damaged one changes nothing)."""
    storage, moto, prefix = s3
    for i in (0, 3, 4):
        storage.write_atomic(manifest_path(i), seal({"id": i}))
    storage.write("ckpt-00000005/rank-00000.bin", b"a save that never committed")
    storage.write_atomic("index.json", b"\x00 not json")
    assert committed_ids(storage) == [0, 3, 4]
    assert existing_dir_ids(storage) == [0, 3, 4, 5]


def test_s3_options_are_checked(moto):
    with pytest.raises(ConfigError, match="unknown key 'endpoint' for s3.*did you mean 'endpoint_url'"):
        Storage(f"s3://{moto.bucket}/x", {**moto.options, "endpoint": moto.endpoint})
    with pytest.raises(ConfigError, match="at least 3 characters"):
        Storage("s3://ab/x", moto.options)


def test_s3_credentials_from_the_environment(moto, monkeypatch):
    """With no storage_options, botocore's own environment variables reach our client."""
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    storage = Storage(f"s3://{moto.bucket}/env")
    try:
        storage.write("ckpt-00000000/a.bin", b"abc")
        assert storage.read("ckpt-00000000/a.bin") == b"abc" and storage.list_dirs() == ["ckpt-00000000"]
    finally:
        storage.close()


@pytest.mark.multirank
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method,bits", [("none", None), ("adaptive", 4)])
def test_s3_round_trip_gc_and_cleanup(moto, method, bits):
    """Baseline + 3 deltas on S3 restored into a fresh model, then GC and torn-directory cleanup on S3."""
    per_rank = R.run_ranks(R.s3_round_trip, 2, (f"s3://{moto.bucket}/rt-{method}", moto.options, method, bits),
                           timeout=200)
    for rank, checks in enumerate(per_rank):
        assert len(checks) == 7 and all(checks.values()), (rank, checks)
    assert moto.keys(f"rt-{method}/") == sorted(f"rt-{method}/{k}" for k in (
        "ckpt-00000005/manifest.json", "ckpt-00000005/rank-00000.bin", "ckpt-00000005/rank-00000.json",
        "ckpt-00000005/rank-00001.bin", "ckpt-00000005/rank-00001.json", "index.json"))


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_s3_kills(moto, tmp_path):
    schedule = [(0, "write.mid", 1, 2), (1, "commit.after_manifest", 0, 1), (0, "random", 0, 0, True)]
    s = R.s3_kill_suite(moto, str(tmp_path), len(schedule), schedule=schedule)
    assert s["kills"] == 3 and s["harness_errors"] == 0, s
    assert s["restores_ok"] == 3 and s["torn_restores"] == 0 and s["lost_commits"] == 0, s["failures"]
    assert s["restart_saves_ok"] == 3 and s["named_fired"] == 2, s
    assert s["kills_with_torn_dirs"] >= 1  # the half-written rank object was there, and was not loaded
