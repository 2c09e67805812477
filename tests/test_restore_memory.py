"""Host memory a restore takes: the residual reconstruction's rows reused, and a host without room to stage.

A restore stages float32 host shards (``restore_rollback``) so that a failure leaves the model as
it was. In a residual job those staged rows become the reconstruction, so the restore stages into
the reconstruction's own rows instead of new memory. These tests check, on the toy model (a
row-wise and a table-wise table, TorchRec's EXACT_ROWWISE_ADAGRAD):

- a restore in a job that holds a reconstruction reuses its rows (the same storage before and
  after) and gives the bits a restore into a freshly built model gives (which has no rows to reuse);
- a restore that fails after taking those rows leaves the next save a baseline;
- a host without the memory to stage restores in place, with a warning, and still bit-exactly;
- TorchRec's TestSparseNN (shared tables, weighted features, every EBC sharding type) and its mixed
  EmbeddingCollection model, on 2 ranks: the restore reuses the reconstruction, and every table shard,
  optimizer state and dense parameter is what a freshly built model's restore gives.
"""

from __future__ import annotations

import pytest
import torch
from _toy import build_dmp, train

from cnr_torchrec.errors import CorruptCheckpointError


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _config(root, **quantization):
    from cnr_torchrec import load_config

    return load_config({"root": root, "keep_last": 10, "on_corrupt": "fail",
                        "quantization": quantization or {"method": "adaptive", "bits": 4, "residual": True}})


def _weights(dmp):
    tracker = dmp.dirty_tracker
    return {(t, tuple(s.rows), tuple(s.cols)): k.tbe.split_embedding_weights()[s.local_index].detach().clone()
            for t in tracker.tables() for k, s in tracker.shards(t)}


def _saved_job(root, specs, config, saves=3):
    """A job that trained and saved ``saves`` times, then trained on: (model, optimizer, Checkpointer, generator)."""
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    for step in range(1, saves + 1):
        train(dmp, specs, opt, 2, gen)
        ck.save(step).wait()
    train(dmp, specs, opt, 2, gen)  # the live rows move on from the newest checkpoint
    return dmp, opt, ck, gen


def test_a_residual_restore_stages_into_the_reconstruction_and_gives_a_fresh_models_bits(group, tmp_path):
    from cnr_torchrec import Checkpointer

    specs = _specs()
    config = _config(str(tmp_path / "root"))
    dmp, opt, ck, _ = _saved_job(str(tmp_path / "root"), specs, config)
    rec = ck._committer.reconstruction
    keys = list(_weights(dmp))
    before = {k: rec.reference(k, None).data_ptr() for k in keys}
    with ck:
        ck.restore()
        after = {k: rec.reference(k, None) for k in keys}
    assert {k: t.data_ptr() for k, t in after.items()} == before  # the same memory, overwritten
    restored = _weights(dmp)
    for k in keys:
        assert torch.equal(after[k], restored[k])  # the reconstruction is what was restored

    fresh, fresh_opt = build_dmp(specs, seed=7)  # another init: nothing of it may survive the restore
    with Checkpointer(fresh, config, dense_optimizer=fresh_opt) as other:
        other.restore()
    for k, w in _weights(fresh).items():
        assert torch.equal(w, restored[k]), k


def test_a_failed_restore_that_took_the_reconstruction_makes_the_next_save_a_baseline(group, tmp_path):
    import os

    specs = _specs()
    root = str(tmp_path / "root")
    dmp, opt, ck, gen = _saved_job(root, specs, _config(root))
    live = _weights(dmp)
    tip = os.path.join(root, "ckpt-00000002", "rank-00000.bin")
    with open(tip, "r+b") as f:  # a byte flipped in every 512 of the tip: on_corrupt: fail raises
        data = bytearray(f.read())
        for at in range(256, len(data), 512):
            data[at] ^= 0xFF
        f.seek(0)
        f.write(data)
    with ck:
        with pytest.raises(CorruptCheckpointError):
            ck.restore()
        for k, w in _weights(dmp).items():
            assert torch.equal(w, live[k]), k  # rolled back
        train(dmp, specs, opt, 1, gen)
        info = ck.save(10).wait()
    assert info.kind == "baseline"


def test_a_host_without_room_to_stage_restores_in_place_with_a_warning(group, tmp_path, monkeypatch, caplog):
    from cnr_torchrec.ckpt import host_memory

    specs = _specs()
    root = str(tmp_path / "root")
    dmp, opt, ck, _ = _saved_job(root, specs, _config(root, method="none", residual=False), saves=2)
    with ck:
        ck.restore()  # room: staged
        saved = _weights(dmp)
        train(dmp, specs, opt, 2, torch.Generator().manual_seed(1))
        monkeypatch.setattr(host_memory, "host_available_bytes", lambda: 1)
        with caplog.at_level("WARNING", logger="cnr_torchrec"):
            ck.restore()
    assert "restore_rollback steps aside for the embedding weights" in caplog.text
    for k, w in _weights(dmp).items():
        assert torch.equal(w, saved[k]), k  # float32 rows: bit-exact, staged or not


def _torchrec_reuse_worker(rank, world_size, root, model):
    """TorchRec's own test model on 2 ranks under plan A, residual-coded: the in-job restore stages into the
    reconstruction's rows, and gives what a freshly built model's restore gives, state for state."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, "A", seed=0)
    config = _config(root)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in (1, 2, 3):
            for s in range(2):
                M.train_step(dmp, opt, M.make_batch(model, seed=100 * rank + 10 * step + s))
            ck.save(step).wait()
        M.train_step(dmp, opt, M.make_batch(model, seed=999 + rank))
        before = M.local_state(dmp, opt)
        rec = ck._committer.reconstruction
        tracker = dmp.dirty_tracker  # its sharded tables (a data_parallel one is stored whole, not coded)
        keys = [(t, tuple(s.rows), tuple(s.cols)) for t in tracker.tables() if not tracker.is_data_parallel(t)
                for _, s in tracker.shards(t)]
        held = {k: rec.reference(k, None).data_ptr() for k in keys}
        ck.restore()
        assert {k: rec.reference(k, None).data_ptr() for k in keys} == held  # the same memory, overwritten
        restored = M.local_state(dmp, opt)
    assert any(not torch.equal(restored[k], v) for k, v in before.items() if torch.is_tensor(v))
    fresh, fresh_opt = M.build_dmp(model, "A", seed=5)
    with Checkpointer(fresh, config, dense_optimizer=fresh_opt) as ck:
        ck.restore()
    M.assert_same(M.local_state(fresh, fresh_opt), restored, f"rank {rank}: a fresh model's restore vs the job's")


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["sparse_nn", "mixed"], ids=["ebc_shared_weighted", "ec"])
def test_torchrecs_models_restore_into_the_reconstruction_as_a_fresh_model_does(tmp_path, model):
    from _dist import run_ranks

    run_ranks(_torchrec_reuse_worker, 2, timeout=280, args=(str(tmp_path / "root"), model))
