"""A plain chain's restore with the rollback on: every byte read and checked, the ranks agreed, then decoded in place.

With ``restore_rollback`` a plain (non-residual) chain is no longer restored into host copies of the shards: each
rank reads and checks every row it will apply, the ranks exchange their outcomes, and only then are the rows
decoded into the live weights (``restore/chain.py``: ``_check_chain``; ``Restorer._commit``). These tests check,
on TorchRec's TestSparseNN (shared tables, weighted features, every EBC sharding type, a data_parallel table)
and its mixed EmbeddingCollection model, with chains the real Checkpointer wrote on 2 ranks:

- the restore gives, state for state and bit for bit, what the same restore with ``restore_rollback: false``
  gives (rows written in place as they are read, the path that never staged), onto the saving plan, onto
  another plan (every table but one changes sharding type) and onto one rank; with float32 rows also the
  saving model's own state at its last save; and it takes no host copy of a shard (``staged_copy_bytes``);
- a chunk of one rank's file that fails its CRC leaves every rank's model exactly as it was (a rank whose
  files are sound must not have written a row), and names the file;
- a rank that fails while writing its checked rows makes every rank raise, none hanging.

Managed-collision tables restored this way (plain chains, rollback on: the defaults there) are checked against
the uninterrupted job in ``test_managed_collision.py``.
"""

from __future__ import annotations

import os

import _torchrec_models as M
import pytest
import torch.distributed as dist
from _dist import run_ranks
from _format_checks import flip_bytes

PLAIN = {"method": "none", "residual": False}  # float32 rows: the restore is the saving model's state
CODED = {"method": "adaptive", "bits": 4, "residual": False}  # 4-bit rows, every delta a whole copy of its rows


def _config(root: str, quantization: dict, **kw):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "keep_last": 10, "compaction": None,
                        "memory_tier": "off", "quantization": quantization, **kw})


def _save_chain(root: str, model: str, quantization: dict, rank: int) -> dict:
    """A baseline and two deltas of a trained model under plan A. Returns its local state at the last save."""
    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, "A", seed=0)
    with Checkpointer(dmp, _config(root, quantization), dense_optimizer=opt) as ck:
        for step in (1, 2, 3):
            for s in range(2):
                M.train_step(dmp, opt, M.make_batch(model, seed=100 * rank + 10 * step + s))
            ck.save(step).wait()
        saved = M.local_state(dmp, opt)
    dist.barrier()
    return saved


def _restored(root: str, model: str, plan: str, quantization: dict, rollback: bool) -> tuple[dict, dict]:
    """A fresh model under ``plan`` (other initial weights than the saved ones), restored: its local state and
    the restore's stats."""
    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, plan, seed=5)
    with Checkpointer(dmp, _config(root, quantization, restore_rollback=rollback), dense_optimizer=opt) as ck:
        assert ck.restore() == 3
        stats = ck.last_restore_stats
    return M.local_state(dmp, opt), stats


def _same_as_in_place(root: str, model: str, plan: str, quantization: dict, rank: int) -> dict:
    want, _ = _restored(root, model, plan, quantization, rollback=False)
    got, stats = _restored(root, model, plan, quantization, rollback=True)
    M.assert_same(got, want, f"rank {rank}, plan {plan}: restore_rollback on vs off")
    assert stats["staged_copy_bytes"] == 0, stats  # no host copy of any shard
    assert stats["check_rows_ms"] > 0 and stats["apply_ms"] > 0, stats  # checked first, then decoded
    return got


def _two_rank_worker(rank: int, world_size: int, root: str, model: str, quantization: dict) -> None:
    saved = _save_chain(root, model, quantization, rank)
    got = _same_as_in_place(root, model, "A", quantization, rank)
    if quantization == PLAIN:
        M.assert_same(got, saved, f"rank {rank}: float32 rows restored vs the saving model at its last save")
    _same_as_in_place(root, model, "B", quantization, rank)  # resharded: every table but one changes type


def _one_rank_worker(rank: int, world_size: int, root: str, model: str, quantization: dict) -> None:
    _same_as_in_place(root, model, "B", quantization, rank)  # plan B is laid out for one rank


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, quantization", [("sparse_nn", PLAIN), ("sparse_nn", CODED), ("mixed", CODED)],
                         ids=["ebc_shared_weighted-fp32", "ebc_shared_weighted-4bit", "ec-4bit"])
def test_a_checked_first_restore_gives_the_in_place_restores_bits_on_every_plan(tmp_path, model, quantization):
    root = str(tmp_path / "root")
    run_ranks(_two_rank_worker, 2, timeout=400, args=(root, model, quantization))
    run_ranks(_one_rank_worker, 1, timeout=180, args=(root, model, quantization))


def _damage_chunk(root: str, ckpt: int, rank_file: str) -> None:
    """Flips one byte in every 512 of one rank file of checkpoint ``ckpt`` (rank 0 edits, all wait)."""
    if dist.get_rank() == 0:
        flip_bytes(os.path.join(root, f"ckpt-{ckpt:08d}", rank_file))
    dist.barrier()


def _corrupt_worker(rank: int, world_size: int, root: str) -> None:
    from cnr_torchrec import Checkpointer, CorruptCheckpointError

    _save_chain(root, "sparse_nn", CODED, rank)
    _damage_chunk(root, 2, "rank-00001.bin")  # the newest delta, rank 1's file: rank 0's files are all sound
    dmp, opt = M.build_dmp("sparse_nn", "A", seed=3)
    M.train_step(dmp, opt, M.make_batch("sparse_nn", seed=77 + rank))  # dense optimizer state to put back too
    before = M.local_state(dmp, opt)
    with Checkpointer(dmp, _config(root, CODED, on_corrupt="fail"), dense_optimizer=opt) as ck:
        with pytest.raises(CorruptCheckpointError, match="rank-00001.bin") as err:
            ck.restore()
        assert "as it was before restore()" in str(err.value)
        assert "commit_ms" not in ck.last_restore_stats  # refused before the commit: nothing decoded
    M.assert_same(M.local_state(dmp, opt), before, f"rank {rank}: the model after a restore refused for a bad chunk")


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_bad_chunk_on_one_rank_leaves_every_ranks_model_as_it_was(tmp_path):
    run_ranks(_corrupt_worker, 2, timeout=280, args=(str(tmp_path / "root"),))


def _write_failure_worker(rank: int, world_size: int, root: str) -> None:
    from cnr_torchrec import Checkpointer, RestoreFailedError
    from cnr_torchrec.ckpt.restore import apply

    _save_chain(root, "sparse_nn", CODED, rank)
    dmp, opt = M.build_dmp("sparse_nn", "A", seed=3)
    M.train_step(dmp, opt, M.make_batch("sparse_nn", seed=77 + rank))
    before = M.local_state(dmp, opt)
    # All but the weights: dense parameters, the dense optimizer's and the tables' optimizer states (the snapshot's).
    kept = {k for k in before if not (isinstance(k, tuple) and k[-1] == "w")}
    if rank == 1:  # what the checks cannot foresee (memory): rank 1 fails while decoding its checked rows
        def no_memory(self, plan, rows):
            raise MemoryError("no memory left to decode into")
        apply.Applier.apply = no_memory  # this worker process's own copy of the class
    with Checkpointer(dmp, _config(root, CODED), dense_optimizer=opt) as ck:
        with pytest.raises(RestoreFailedError, match="rank 1 could not write the rows") as err:
            ck.restore()
    assert "partly overwritten" in str(err.value) and "restore again" in str(err.value)
    after = M.local_state(dmp, opt)
    M.assert_same({k: after[k] for k in kept}, {k: before[k] for k in kept}, f"rank {rank}: the state put back")


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_rank_that_fails_to_write_its_checked_rows_makes_every_rank_raise(tmp_path):
    run_ranks(_write_failure_worker, 2, timeout=280, args=(str(tmp_path / "root"),))
