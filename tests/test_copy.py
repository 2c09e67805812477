"""``cnr copy``: a root copied to another storage, never torn.

The source is the publishing tests' 2-rank root (``_publish_job``: a residual chain 0..2, then a new baseline 3
and a delta 4 on it). The reference is ``Checkpointer.restore()`` of the source: a restore from the copy must
give the same tables and dense layers, bit for bit. A copy stopped at each named point (a payload chunk, a part,
the manifest, the index) leaves a destination that ``cnr verify`` passes and that restores as the source's
newest checkpoint it committed; run again, it skips what is there and ends as a whole copy. So does a ``cnr copy``
process SIGKILLed half-way through a file (the ``write.mid`` fault point). Between two local roots the kernel
copies each chunk, and what is checked is what landed: a destination that changes a chunk's bytes is refused and
the bad copy deleted; where the kernel cannot copy (another filesystem), the bytes are read and written instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from _publish_job import restored

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.fixture
def job(publish_job):
    return publish_job


def _cnr(capsys, *argv):
    from cnr_torchrec.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _committed(root, options=None):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids

    storage = Storage(root, options)
    try:
        return committed_ids(storage)
    finally:
        storage.close()


def _assert_same_restore(a, b):
    (ta, da), (tb, db) = restored(a), restored(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[t], tb[t]) for t in ta)
    assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)


def test_a_copy_of_the_newest_chain_restores_as_the_source_does(group, job, tmp_path, capsys):
    src, dst = job[-1], str(tmp_path / "dst")
    code, out, err = _cnr(capsys, "copy", src, dst)
    assert code == 0, err
    assert "copied checkpoints 3-4" in out
    assert _committed(dst) == [3, 4]
    _assert_same_restore(dst, src)
    code, out, _ = _cnr(capsys, "copy", src, dst)  # again: nothing to do
    assert code == 0 and "copied checkpoints none" in out and "already there: 3-4" in out


def test_every_checkpoint_through_s3_and_back(group, job, tmp_path, capsys):
    pytest.importorskip("moto")
    import reliability as R

    server = R.Moto()
    try:
        s3 = f"s3://{server.bucket}/copies/all"
        flags = [a for k, v in server.options.items() for a in ("--dst-storage-option", f"{k}={v}")]
        code, _, err = _cnr(capsys, "copy", job[-1], s3, "--all", *flags)
        assert code == 0, err
        assert _committed(s3, server.options) == [0, 1, 2, 3, 4]
        back = str(tmp_path / "back")
        flags = [a for k, v in server.options.items() for a in ("--storage-option", f"{k}={v}")]
        code, _, err = _cnr(capsys, "copy", s3, back, "--all", *flags)
        assert code == 0, err
    finally:
        server.close()
    assert _committed(back) == [0, 1, 2, 3, 4]
    _assert_same_restore(back, job[-1])
    assert _cnr(capsys, "verify", back)[0] == 0


POINTS = {"a chunk": "ckpt-00000004/rank-00001.bin", "a part": "ckpt-00000004/rank-00001.json",
          "the manifest": "ckpt-00000004/manifest.json", "the index": "index.json"}


@pytest.mark.parametrize("point", sorted(POINTS))
def test_a_copy_stopped_at_each_point_is_never_torn_and_resumes(group, job, tmp_path, capsys, monkeypatch, point):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    src, dst = job[-1], str(tmp_path / "dst")
    real_write, real_atomic = Storage.write, Storage.write_atomic

    def stop_at(real):
        def write(self, path, data):
            if self.root.startswith(dst) and path == POINTS[point]:
                raise KeyboardInterrupt  # as a kill there would
            return real(self, path, data)
        return write

    with monkeypatch.context() as m:
        m.setattr(Storage, "write", stop_at(real_write))
        m.setattr(Storage, "write_atomic", stop_at(real_atomic))
        assert _cnr(capsys, "copy", src, dst)[0] == 130
    committed = _committed(dst)
    assert committed == ([3, 4] if point == "the index" else [3])
    assert _cnr(capsys, "verify", dst)[0] == 0
    _assert_same_restore(dst, job[-1] if point == "the index" else job[3])  # the newest it committed
    code, out, err = _cnr(capsys, "copy", src, dst)
    assert code == 0, err
    assert _committed(dst) == [3, 4]
    assert ("already there: 3" in out) and (point != "a part" or "files found whole already" in out)
    _assert_same_restore(dst, src)


def test_a_corrupt_source_file_stops_the_copy_before_its_checkpoint_commits(group, job, tmp_path, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shutil.copytree(job[-1], src)
    path = os.path.join(src, "ckpt-00000004", "rank-00000.bin")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    code, _, err = _cnr(capsys, "copy", src, dst)
    assert code == 1 and "ckpt-00000004/rank-00000.bin" in err
    assert _committed(dst) == [3]


def test_a_destination_holding_another_checkpoint_under_the_same_id_is_refused(group, job, tmp_path, capsys):
    dst = str(tmp_path / "dst")
    shutil.copytree(job[0], dst)  # checkpoint 0 of the same job, but its ids 3, 4 free: copy the old chain in
    code, _, err = _cnr(capsys, "copy", job[-1], dst, "--all")
    assert code == 0, err
    other = str(tmp_path / "other")
    shutil.copytree(job[1], other)
    manifest = os.path.join(other, "ckpt-00000001", "manifest.json")
    doc = open(manifest, "rb").read()
    open(manifest, "wb").write(doc.replace(b'"reason"', b'"reason" ', 1))  # another manifest under id 1
    code, _, err = _cnr(capsys, "copy", job[-1], other, "--all")
    assert code == 2 and "holds another checkpoint 1 than" in err
    assert json.loads(open(os.path.join(dst, "index.json")).read())["committed"] == [0, 1, 2, 3, 4]


def test_a_compacting_copy_arrives_as_one_baseline_that_restores_as_the_chain(group, job, tmp_path, capsys):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import load_manifest

    src, dst = job[-1], str(tmp_path / "dst")
    code, out, err = _cnr(capsys, "copy", src, dst, "--compact")
    assert code == 0, err
    assert "copied checkpoints 3-4 as one baseline" in out
    (only,) = _committed(dst)
    storage = Storage(dst)
    m = load_manifest(storage, only)
    storage.close()
    assert m.kind == "baseline" and m.equals == 4 and m.parent is None
    _assert_same_restore(dst, src)
    assert _cnr(capsys, "verify", dst)[0] == 0
    code, out, _ = _cnr(capsys, "copy", src, dst, "--compact")  # again: the compaction is there already
    assert code == 0 and "already there: 3-4" in out and _committed(dst) == [only]
    code, _, err = _cnr(capsys, "copy", src, str(tmp_path / "other"), "--compact", "--all")
    assert code == 2 and "without --all" in err


def _writes(root, cid):
    """The files ``cnr copy`` writes for checkpoint ``cid`` of ``root`` before its manifest: its chunks and parts."""
    return len([f for f in os.listdir(os.path.join(root, f"ckpt-{cid:08d}")) if f != "manifest.json"])


@pytest.mark.parametrize("which", ["the first file", "a chunk of the second checkpoint",
                                   "the last file of the second checkpoint"])
def test_a_copy_killed_half_way_through_a_file_is_never_torn_and_resumes(group, job, tmp_path, capsys, which):
    import subprocess

    src, dst = job[-1], str(tmp_path / "dst")
    first = _writes(src, 3)
    nth = {"the first file": 1, "a chunk of the second checkpoint": first + 1,
           "the last file of the second checkpoint": first + _writes(src, 4)}[which]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CNR_FAULT": f"write.mid:nth={nth}", "PYTHONPATH": repo}
    env.pop("RANK", None)
    killed = subprocess.run([sys.executable, "-m", "cnr_torchrec.cli", "copy", src, dst], env=env, timeout=120,
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr  # SIGKILLed half-way through the file, as a lost machine is
    committed = _committed(dst)
    assert committed == ([] if nth == 1 else [3])
    if committed:
        assert _cnr(capsys, "verify", dst)[0] == 0
        _assert_same_restore(dst, job[3])
    code, out, err = _cnr(capsys, "copy", src, dst)
    assert code == 0, err
    assert _committed(dst) == [3, 4]
    _assert_same_restore(dst, src)
    assert _cnr(capsys, "verify", dst)[0] == 0


def test_a_copy_that_lands_changed_is_deleted_named_and_not_committed(group, job, tmp_path, capsys, monkeypatch):
    src, dst = job[-1], str(tmp_path / "dst")
    target = os.path.join(dst, "ckpt-00000004", "rank-00000.bin")
    real = os.copy_file_range

    def flipping(fd_in, fd_out, count, offset_src=None, offset_dst=None):
        n = real(fd_in, fd_out, count, offset_src, offset_dst)
        if os.readlink(f"/proc/self/fd/{fd_out}") == target and offset_dst == 0 and n:
            with open(target, "r+b") as f:  # a destination that changes what it was given
                byte = f.read(1)
                f.seek(0)
                f.write(bytes([byte[0] ^ 0x01]))
        return n

    monkeypatch.setattr(os, "copy_file_range", flipping)
    code, _, err = _cnr(capsys, "copy", src, dst)
    assert code == 1, err
    assert "copy of ckpt-00000004/rank-00000.bin" in err and "does not match its digest" in err
    assert not os.path.exists(target)
    assert _committed(dst) == [3]


def test_where_the_kernel_cannot_copy_between_the_roots_the_bytes_are_read_and_written(group, job, tmp_path, capsys,
                                                                                      monkeypatch):
    import errno

    src, dst = job[-1], str(tmp_path / "dst")
    refused = []

    def other_filesystem(fd_in, fd_out, count, offset_src=None, offset_dst=None):
        refused.append(fd_out)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", other_filesystem)
    code, _, err = _cnr(capsys, "copy", src, dst)
    assert code == 0, err
    assert refused and _committed(dst) == [3, 4]
    _assert_same_restore(dst, src)
