"""``cnr publish``: a serving snapshot in a directory, kept current with the training job's root.

The job (``_publish_job``) is shown as its root stood after each save. After each run of ``cnr publish``,
``OUT/current/model.pt`` must hold what ``Checkpointer.restore()`` of the newest checkpoint gives a sharded
model: float32 rows as restored, int8 rows byte for byte as FBGEMM's own row-wise quantizer makes them of
the restored rows. A second run resumes from the snapshot (deltas, not a reload); an interrupted run, at
each point of writing a version, leaves ``current`` at a whole version that the next run resumes from; a
snapshot whose files do not match its cursor is reloaded; another root's or dtype's snapshot is refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from _publish_job import restored, show


@pytest.fixture
def job(publish_job):
    return publish_job


def _publish(root, out, *extra):
    from cnr_torchrec.cli import main

    return main(["publish", root, "--out", out, *extra])


def _model_pt(out):
    return torch.load(os.path.join(out, "current", "model.pt"), weights_only=True)


def _assert_published(out, root, dtype="fp32"):
    """OUT/current/model.pt holds the restore's tables in ``dtype`` and its dense layer as restored."""
    (want, dense), state = restored(root), _model_pt(out)
    assert all(torch.equal(state[k], v) for k, v in dense.items())
    got = {name.split(".")[-2]: w for name, w in state.items() if ".embedding" in name}  # ebc.embedding_bags.t0.weight
    assert set(got) == set(want)
    for t, w in want.items():
        if dtype == "int8":
            w = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(w, 8)
        assert torch.equal(got[t], w), (t, dtype)


def _cursor(out):
    return json.load(open(os.path.join(out, "current", "cursor.json")))["cursor"]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_cnr_publish_resumes_from_its_snapshot_and_publishes_what_a_restore_gives(group, job, tmp_path, capsys, dtype):
    root, out = str(tmp_path / "root"), str(tmp_path / "serving")
    show(job[0], root)
    assert _publish(root, out, "--dtype", dtype) == 0
    assert "published checkpoint 0 (step 1)" in capsys.readouterr().out
    _assert_published(out, root, dtype)
    show(job[2], root)
    assert _publish(root, out, "--dtype", dtype) == 0  # a new process: it resumes from OUT
    printed = capsys.readouterr().out
    assert "checkpoint 1 (step 2) to" in printed and "checkpoint 2 (step 3)" in printed
    assert printed.count(": delta on checkpoint") == 2 and "reload" not in printed
    _assert_published(out, root, dtype)
    assert _publish(root, out, "--dtype", dtype) == 0
    assert "already serves the newest" in capsys.readouterr().out
    show(job[3], root)
    assert _publish(root, out, "--dtype", dtype) == 0
    assert "reload a new baseline, 3" in capsys.readouterr().out
    _assert_published(out, root, dtype)
    assert sorted(os.listdir(out)) == ["current", "v0000000002", "v0000000003"]  # the version before stays


def _interrupt_at(monkeypatch, point):
    """Makes the next version's write stop at ``point``, as a kill there would."""
    from cnr_torchrec.publish import snapshot

    def stop(*_):
        raise KeyboardInterrupt

    if point == "a file":  # model.pt written and fsynced, rows.pt not yet
        real = snapshot._save

        def save_then_stop(state, path):
            real(state, path)
            stop()

        monkeypatch.setattr(snapshot, "_save", save_then_stop)
    else:  # the version renamed into place, the link not yet replaced
        monkeypatch.setattr(snapshot.os, "symlink", stop)


@pytest.mark.parametrize("point", ["a file", "the link"])
def test_an_interrupted_publish_leaves_the_version_before_and_the_next_run_resumes_from_it(
        group, job, tmp_path, monkeypatch, point):
    root, out = str(tmp_path / "root"), str(tmp_path / "serving")
    show(job[0], root)
    assert _publish(root, out, "--dtype", "int8") == 0
    before = _model_pt(out)
    show(job[1], root)
    with monkeypatch.context() as m:
        _interrupt_at(m, point)
        assert _publish(root, out, "--dtype", "int8") == 130
    assert _cursor(out)["ckpt"] == 0
    assert all(torch.equal(w, before[n]) for n, w in _model_pt(out).items())  # whole, and the one before
    assert _publish(root, out, "--dtype", "int8") == 0
    assert _cursor(out)["ckpt"] == 1
    _assert_published(out, root, "int8")
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]


def test_a_snapshot_whose_files_do_not_match_its_cursor_is_reloaded_from_the_root(group, job, tmp_path, capsys, caplog):
    root, out = str(tmp_path / "root"), str(tmp_path / "serving")
    show(job[0], root)
    assert _publish(root, out, "--dtype", "int8") == 0
    rows = os.path.join(out, "current", "rows.pt")
    state = torch.load(rows, weights_only=True)
    next(iter(state.values()))[0, 0] += 1.0  # the float rows a restart would go on from
    torch.save(state, rows)
    show(job[1], root)
    with caplog.at_level("WARNING", logger="cnr_torchrec.publish.snapshot"):
        assert _publish(root, out, "--dtype", "int8") == 0
    assert "rows.pt in" in caplog.text and "does not match its cursor; reloading" in caplog.text
    assert "reload the first load" in capsys.readouterr().out
    _assert_published(out, root, "int8")


def test_a_rewritten_root_under_the_cursors_ids_is_reloaded_not_resumed(group, job, tmp_path):
    from cnr_torchrec.publish import Follower
    from cnr_torchrec.publish.snapshot import SnapshotTarget

    root = str(tmp_path / "root")
    show(job[1], root)
    with Follower(root, SnapshotTarget("fp32")) as first:
        first.poll()
        cursor, rows = first.cursor, {t: w.clone() for t, w in first.served_rows.items()}
    changed = type(cursor)(cursor.root, cursor.ckpt, cursor.step, cursor.chain, "0" * 32)
    with Follower(root, SnapshotTarget("fp32")) as again:
        again.resume(cursor, rows)
        assert again.poll() == []  # resumed where it was: nothing new
    with Follower(root, SnapshotTarget("fp32")) as again:
        again.resume(changed, rows)
        (update,) = again.poll()
        assert update.how == "reload" and "differ from the cursor's digest" in update.why


def test_cnr_publish_refuses_another_roots_or_dtypes_snapshot_by_name(group, job, tmp_path, capsys):
    root, out = str(tmp_path / "root"), str(tmp_path / "serving")
    show(job[0], root)
    assert _publish(root, out, "--dtype", "int8") == 0
    capsys.readouterr()
    assert _publish(root, out, "--dtype", "fp16") == 2
    assert "holds a int8 snapshot of tables" in capsys.readouterr().err
    other = str(tmp_path / "other")
    show(job[0], other)
    assert _publish(other, out, "--dtype", "int8") == 2
    assert f"holds a snapshot of {root}, not of {other}" in capsys.readouterr().err
    open(str(tmp_path / "file"), "w").close()
    assert _publish(root, str(tmp_path / "file")) == 2
    assert "is a file; give cnr publish a directory" in capsys.readouterr().err


def test_a_corrupt_checkpoint_after_good_ones_publishes_the_good_ones_and_exits_1(group, job, tmp_path, capsys):
    from test_publish import _flip_a_stored_row

    root, out = str(tmp_path / "root"), str(tmp_path / "serving")
    show(job[0], root)
    assert _publish(root, out) == 0
    show(job[2], root)
    _flip_a_stored_row(root, 2, rank=1)
    assert _publish(root, out) == 1  # delta 1 applied, delta 2 refused
    assert "ckpt-00000002" in capsys.readouterr().err
    assert _cursor(out)["ckpt"] == 1
    show(job[1], str(tmp_path / "at1"))
    _assert_published(out, str(tmp_path / "at1"))
