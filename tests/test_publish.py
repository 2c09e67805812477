"""The follower: a training job's committed checkpoints applied in order to an unsharded serving model.

The job (``_publish_job``) saves residual deltas, then a new baseline and a delta on it; the follower is
shown its root as it stood after each save. After each poll, every served table must equal what
``Checkpointer.restore()`` of that checkpoint gives a sharded model. Then the cases a follower must
name: the checkpoint it serves collected, a checkpoint that fails its checks (the copy stays at the
version before), another model's root, another root's cursor.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from _publish_job import assert_serves, restored_tables, served, serving_model, show, specs

@pytest.fixture
def job(publish_job):
    return publish_job


def _first(job, root):
    """``root`` as it stood after the first save."""
    show(job[0], root)
    return root


def test_a_follower_applies_each_commit_in_order_and_serves_what_a_restore_gives(group, job, tmp_path):
    from cnr_torchrec.publish import Follower

    root, cursor = str(tmp_path / "root"), str(tmp_path / "cursor.json")
    model = serving_model()
    seen = []
    with Follower(_first(job, root), model, cursor=cursor) as follower:
        for i, snapshot in enumerate(job):
            show(snapshot, root)
            updates = follower.poll()
            seen += [(u.ckpt, u.how) for u in updates]
            assert_serves(model, root)
            assert json.load(open(cursor))["ckpt"] == follower.cursor.ckpt == updates[-1].ckpt
            if i in (0, 3):  # the first load, the new baseline
                assert updates[-1].how == "reload" and updates[-1].rows > 0
            else:
                assert [u.how for u in updates] == ["delta"] and 0 < updates[-1].rows
            assert follower.poll() == []  # nothing new: nothing applied
    assert seen == [(0, "reload"), (1, "delta"), (2, "delta"), (3, "reload"), (4, "delta")]


def test_a_follower_that_missed_commits_applies_each_of_them_once_in_order(group, job, tmp_path):
    from cnr_torchrec.publish import Follower

    root = str(tmp_path / "root")
    model = serving_model()
    with Follower(_first(job, root), model) as follower:
        assert [u.ckpt for u in follower.poll()] == [0]
        show(job[2], root)  # two deltas committed between polls
        assert [(u.ckpt, u.how) for u in follower.poll()] == [(1, "delta"), (2, "delta")]
        assert_serves(model, root)


def test_a_served_checkpoint_collected_is_named_and_the_follower_reloads(group, job, tmp_path, caplog):
    from cnr_torchrec.publish import Follower

    root = str(tmp_path / "root")
    model = serving_model()
    with Follower(_first(job, root), model) as follower:
        follower.poll()
        show(job[3], root)
        for cid in (0, 1, 2):  # the old chain, as retention collects it once the new baseline committed
            shutil.rmtree(os.path.join(root, f"ckpt-{cid:08d}"))
        with caplog.at_level("INFO", logger="cnr_torchrec.publish.follower"):
            (update,) = follower.poll()
        assert update.how == "reload" and "checkpoint 0, which it served, is gone" in update.why
        assert "checkpoint 0, which it served, is gone" in caplog.text
        assert_serves(model, root)


def _flip_a_stored_row(root, ckpt_id, rank):
    """Flips a byte of the first stored row of rank ``rank``'s first entry with rows in checkpoint ``ckpt_id``."""
    from cnr_torchrec.ckpt.format.parts import expand_part

    d = os.path.join(root, f"ckpt-{ckpt_id:08d}")
    part = expand_part(json.load(open(os.path.join(d, f"rank-{rank:05d}.json"))))
    entry = next(e for es in part["tables"].values() for e in es if e.get("ids", {}).get("count", 1))
    blob = part["blobs"][next(iter(entry["weights"]["blobs"].values()))]
    path = os.path.join(d, f"rank-{rank:05d}.bin")  # chunk 0 holds it: these payloads are one chunk
    data = bytearray(open(path, "rb").read())
    data[blob["offset"]] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_a_checkpoint_that_fails_its_checks_is_never_served(group, job, tmp_path):
    from cnr_torchrec.errors import CorruptCheckpointError
    from cnr_torchrec.publish import Follower

    root = str(tmp_path / "root")
    model = serving_model()
    with Follower(_first(job, root), model) as follower:
        follower.poll()
        before = {t: w.clone() for t, w in served(model).items()}
        show(job[1], root)
        _flip_a_stored_row(root, 1, rank=1)
        with pytest.raises(CorruptCheckpointError, match="ckpt-00000001"):
            follower.poll()
        assert all(torch.equal(w, before[t]) for t, w in served(model).items())  # still checkpoint 0, whole
        assert follower.cursor.ckpt == 0
        assert follower.poll() == []  # not tried again: deltas on it cannot be served either
        show(job[3], root)  # a new baseline: served again
        assert [u.how for u in follower.poll()] == ["reload"]
        assert_serves(model, root)


def test_another_models_root_and_another_roots_cursor_are_refused_by_name(group, job, tmp_path):
    from examples.toy import TableSpec, ToyModel

    from cnr_torchrec.errors import ConfigError, IncompatibleCheckpointError
    from cnr_torchrec.publish import Follower

    root, cursor = str(tmp_path / "root"), str(tmp_path / "cursor.json")
    other = ToyModel([TableSpec("t0", 65, 8, "row_wise")], device="cpu")
    with Follower(_first(job, root), other, cursor=cursor) as follower:
        with pytest.raises(IncompatibleCheckpointError, match=r"table 't0' as \[64, 8\], the target as \[65, 8\]"):
            follower.poll()
    with Follower(root, serving_model(), cursor=cursor) as follower:
        follower.poll()
    with pytest.raises(ConfigError, match="the cursor of a follower of .*root, not of"):
        Follower(str(tmp_path / "elsewhere"), serving_model(), cursor=cursor)


INT4 = {"t2": torch.quint4x2, "s0": torch.quint4x2}  # the rest int8, TorchRec's default


def _quantized(tables=None):
    """TorchRec's inference model of the toy model (its own quantization), from ``tables`` (float, by name) or
    from a fresh initialisation."""
    from torchrec.inference.modules import quantize_inference_model

    model = serving_model()
    if tables is not None:
        with torch.no_grad():
            for t, w in served(model).items():
                w.copy_(tables[t])
    return quantize_inference_model(model, per_table_weight_dtype=INT4)


def _quant_rows(model):
    """Each table's rows as TorchRec's quantized modules hold them (codes with scale and bias, and padding)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    out = {}
    for m in model.modules():
        if isinstance(m, IntNBitTableBatchedEmbeddingBagsCodegen):
            for (table, *_), (rows, _) in zip(m.embedding_specs, m.split_embedding_weights(split_scale_shifts=False)):
                out[table] = rows.clone()
    return out


def test_torchrecs_quantized_modules_serve_each_commit_as_torchrec_quantizes_the_restored_rows(group, job, tmp_path):
    """int8 and int4 tables of TorchRec's inference model, written through FBGEMM's embedding_inplace_update:
    after each commit, byte for byte what quantize_inference_model makes of the restored float tables."""
    from cnr_torchrec.publish import Follower

    root = str(tmp_path / "root")
    serving = _quantized()
    with Follower(_first(job, root), serving) as follower:
        for snapshot in job:
            show(snapshot, root)
            follower.poll()
            want, got = _quant_rows(_quantized(restored_tables(root))), _quant_rows(serving)
            assert set(got) == set(want) == {s.name for s in specs()}
            for t in want:
                assert torch.equal(got[t], want[t]), (t, int((got[t] != want[t]).sum()))
