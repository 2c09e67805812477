"""Several jobs on one host: each root's memory images in a directory of their own, and when they go.

On the toy model (a row-wise and a table-wise table, TorchRec's EXACT_ROWWISE_ADAGRAD), residual-coded:

- two jobs with the default ``memory_tier`` (``/dev/shm``), the first killed before the second starts:
  both restart from their own images (another job never removes them);
- a job that opens a root removes another root's images only where that root is gone (a local root, and
  images that were sealed) or nothing in them changed for ``memory_tier.max_age_s``, and old-layout files
  by age (its own root's at once); an unsealed directory of a missing root, a remote root's and fresh
  old-layout files stay;
- ``cnr clean-images`` removes what it says (the stale ones, one root's, all) and never another user's.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from _toy import build_dmp, train

DAY = 86400.0


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _config(root, shm=None, **memory_tier):
    """The job's config; without ``shm`` its memory_tier is the default one."""
    from cnr_torchrec import load_config

    tier = {"memory_tier": {"path": shm, **memory_tier}} if shm is not None else {}
    return load_config({"root": root, "keep_last": 10, "on_corrupt": "fail",
                        "quantization": {"method": "adaptive", "bits": 4, "residual": True}, **tier})


def _killed_job(root, shm=None, saves=2, **memory_tier):
    """A job that saves ``saves`` times and stops as a killed one would: its images stay."""
    from cnr_torchrec import Checkpointer

    specs = _specs()
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer(dmp, _config(root, shm, **memory_tier), dense_optimizer=opt)
    assert ck._memory.active, ck._memory.why_off
    for step in range(1, saves + 1):
        train(dmp, specs, opt, 2, gen)
        ck.save(step).wait()
    ck.close(keep_images=True)


def _restart_source(root, shm=None, keep=True):
    """Where a restarted job's restore took its shards from ("memory" or "storage"), and why."""
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(_specs(), seed=7)
    ck = Checkpointer(dmp, _config(root, shm), dense_optimizer=opt)
    ck.restore()
    (_, source, why), = ck.last_restore_sources
    ck.close(keep_images=keep)
    return source, why


def _dir(shm, root):
    from cnr_torchrec.ckpt.memory.directory import root_dir

    return root_dir(shm, root)


def _age(path, seconds):
    """Sets the modification time of ``path`` and of every file in it ``seconds`` in the past."""
    then = time.time() - seconds
    os.utime(path, (then, then))
    for d, _, files in os.walk(path):
        for f in files:
            os.utime(os.path.join(d, f), (then, then))
        os.utime(d, (then, then))


def _fake(shm, name, root=None, files=("r00000.img", "r00000.seal")):
    """An image directory ``name`` under ``shm`` naming ``root`` (or, for a name with a suffix, one flat
    old-layout file), the user's own, mode 0600."""
    path = os.path.join(shm, name)
    if "." in name:
        open(path, "wb").close()
        os.chmod(path, 0o600)
        return path
    os.mkdir(path, 0o700)
    for f in files:
        with open(os.path.join(path, f), "wb") as out:
            out.write(b"x" * 64)
    if root is not None:
        with open(os.path.join(path, "root"), "w") as out:
            out.write(root + "\n")
    return path


def test_two_jobs_with_the_default_memory_tier_restart_each_from_its_own_images(group, tmp_path):
    """Job A is killed, job B starts on the same host and is killed too; both restart from memory."""
    from cnr_torchrec import MemoryTierConfig

    shm = MemoryTierConfig().path
    if not os.path.isdir(shm):
        pytest.skip(f"no {shm} on this host")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert _config(a).memory_tier == MemoryTierConfig()
    try:
        _killed_job(a)
        _killed_job(b)
        assert _restart_source(a) == ("memory", "sealed for the agreed checkpoint")
        assert _restart_source(b, keep=False) == ("memory", "sealed for the agreed checkpoint")
        assert os.path.isdir(_dir(shm, a)) and not os.path.exists(_dir(shm, b))  # B's clean end: its images go
        assert _restart_source(a, keep=False)[0] == "memory"
        assert not os.path.exists(_dir(shm, a))
    finally:
        for root in (a, b):
            shutil.rmtree(_dir(shm, root), ignore_errors=True)


def test_a_job_removes_gone_and_aged_images_of_other_roots_and_nothing_else(group, tmp_path):
    from cnr_torchrec.ckpt.format.bytes.roots import root_digest

    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    gone, aged, fresh = (str(tmp_path / n) for n in ("gone", "aged", "fresh"))
    for root in (gone, aged, fresh):
        _killed_job(root, shm, saves=1)
    shutil.rmtree(gone)  # its root deleted: no restart will take its images
    _age(_dir(shm, aged), 2 * 3600)  # older than max_age_s below
    _age(_dir(shm, fresh), 1800)  # younger
    unsealed = _fake(shm, "cnr-" + "1" * 16, str(tmp_path / "not-made-yet"), files=("r00000.img",))
    remote = _fake(shm, "cnr-" + "2" * 16, "s3://bucket/ckpt")
    _age(remote, 1800)
    old_layout = _fake(shm, f"cnr-{'3' * 16}-r00000.img")
    _age(old_layout, 2 * 3600)
    new_layout = _fake(shm, f"cnr-{'4' * 16}-r00000.seal")
    mine = str(tmp_path / "mine")
    own_old = _fake(shm, f"cnr-{root_digest(mine)}-r00000.img")  # this root's images of an older version

    _killed_job(mine, shm, saves=1, max_age_s=3600)

    left = sorted(os.listdir(shm))
    want = sorted(os.path.basename(p) for p in (_dir(shm, fresh), unsealed, remote, new_layout, _dir(shm, mine)))
    assert left == want, left
    assert not os.path.exists(own_old)
    assert _restart_source(fresh, shm)[0] == "memory"  # what stayed still restores


def _clean(capsys, *argv):
    from cnr_torchrec.cli import main

    code = main(["clean-images", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cnr_clean_images_removes_what_it_says_and_never_another_users(group, tmp_path, capsys, monkeypatch):
    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    a, b, c = (str(tmp_path / n) for n in "abc")
    for root in (a, b, c):
        _killed_job(root, shm, saves=1)
    _age(_dir(shm, c), 2 * DAY)
    old_layout = _fake(shm, f"cnr-{'3' * 16}-r00000.img")
    names = lambda: sorted(os.listdir(shm))  # noqa: E731
    everything = names()

    code, out, _ = _clean(capsys, "--path", shm, "--dry-run")  # the stale ones: c's, a day old
    assert code == 0 and f"would remove {_dir(shm, c)} (root {c}, 3 file(s)" in out and "unchanged for 48.0 h" in out
    assert names() == everything
    code, out, _ = _clean(capsys, "--path", shm)
    assert code == 0 and "removed the images of 1 root(s)" in out and "kept the images of 3 root(s)" in out
    assert not os.path.exists(_dir(shm, c)) and len(names()) == 3

    code, out, _ = _clean(capsys, "--path", shm, "--root", os.path.relpath(a))  # a relative path names it too
    assert code == 0 and f"removed {_dir(shm, a)} (root {a}" in out
    assert sorted(names()) == sorted([os.path.basename(_dir(shm, b)), os.path.basename(old_layout)])
    assert _restart_source(b, shm)[0] == "memory"  # what it did not name still restores

    monkeypatch.setattr(os, "getuid", lambda: 4242)
    code, out, _ = _clean(capsys, "--path", shm, "--all")
    monkeypatch.undo()
    assert code == 0 and "removed nothing" in out and len(names()) == 2  # another user's files: never touched
    code, out, _ = _clean(capsys, "--path", shm, "--all")
    assert code == 0 and "old-layout files" in out and names() == []

    code, _, err = _clean(capsys, "--path", str(tmp_path / "missing"))
    assert code == 2 and "ConfigError" in err and "is not a directory" in err
    code, _, err = _clean(capsys, "--path", shm, "--max-age-s", "0")
    assert code == 2 and "positive number of seconds" in err
    code, _, err = _clean(capsys, "--root", a, "--all")
    assert code == 2 and "not allowed with" in err


def test_a_root_wiped_and_reused_under_its_path_never_restores_the_old_jobs_images(group, tmp_path):
    """Job A leaves images sealed for its checkpoint 1; its root is wiped and job B (without the tier) writes its
    own checkpoints 0 and 1 there. The images name the same root and checkpoint id, but not B's payload: a restart
    reads storage, and restores B's model."""
    from cnr_torchrec import Checkpointer

    shm, root = str(tmp_path / "shm"), str(tmp_path / "root")
    os.mkdir(shm)
    _killed_job(root, shm)
    assert os.path.exists(os.path.join(_dir(shm, root), "r00000.seal"))
    shutil.rmtree(root)
    specs = _specs()
    dmp, opt = build_dmp(specs, seed=3)
    gen = torch.Generator().manual_seed(3)
    with Checkpointer(dmp, _config(root, shm, mode="off"), dense_optimizer=opt) as ck:
        for step in (1, 2):
            train(dmp, specs, opt, 2, gen)
            ck.save(step).wait()
    assert os.path.exists(os.path.join(_dir(shm, root), "r00000.seal"))  # A's images are still there
    assert _restart_source(root, shm, keep=False)[0] == "storage"


def _restored_state(root, shm, **memory_tier):
    """(where the shards came from, this rank's shards and optimizer states) after a restart's restore."""
    from _toy import local_state

    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(_specs(), seed=7)
    ck = Checkpointer(dmp, _config(root, shm, **memory_tier), dense_optimizer=opt)
    ck.restore()
    (_, source, _), = ck.last_restore_sources
    ck.close(keep_images=True)
    return source, local_state(dmp)


def test_an_image_sealed_by_a_storage_restore_holds_the_optimizer_state_the_restore_gave(group, tmp_path):
    """The host lost its images; the restart reads storage and seals a new image. A second restart takes that
    image: its weights and row-wise optimizer state must be a storage restore's, bit for bit."""
    shm, root = str(tmp_path / "shm"), str(tmp_path / "root")
    os.mkdir(shm)
    _killed_job(root, shm)
    shutil.rmtree(_dir(shm, root))
    assert _restored_state(root, shm)[0] == "storage"
    source, got = _restored_state(root, shm)
    assert source == "memory"
    _, want = _restored_state(root, shm, mode="off")
    assert got.keys() == want.keys() and any(isinstance(k[2], int) for k in want if isinstance(k, tuple))
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
