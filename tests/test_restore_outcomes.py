"""What a restore leaves behind: the model it found when it fails, and the global RNGs unless asked.

TorchRec's TestSparseNN on 2 gloo ranks under plan "A" (shared tables, id-score tables, mixed dims,
every EBC sharding type), restored by the real Checkpointer:
- a root whose every checkpoint fails part way through its rows raises RestoreFailedError (never
  CheckpointNotFoundError), and every table shard, fused optimizer state, dense parameter and dense
  optimizer state is bit-identical to before, on both ranks; with ``restore_rollback: false`` the same
  restore is seen to overwrite rows, which is what the first case guards against;
- an empty root is CheckpointNotFoundError, and changes nothing;
- a successful restore leaves torch's, Python's and NumPy's global RNGs as the job set them, unless
  ``restore_rng: true``, when they continue where the saving job's left off.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import _torchrec_models as M

pytestmark = pytest.mark.multirank

MODEL, PLAN = "sparse_nn", "A"


class Position:
    """A stateful reader position (extra_state): what a restore must put back too."""

    def __init__(self, at: int) -> None:
        self.at = at

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = int(state["at"])


PLAIN = {"method": "none", "residual": False}  # fp32 rows: a restore is bit-exact
RESIDUAL = {"method": "adaptive", "bits": 4, "residual": True}  # the default coding: the chain adds up


def _config(root: str, quantization: dict | None = None, **kw):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "quantization": quantization or PLAIN,
                        "keep": {"chains": 4}, **kw})


def _train(dmp, opt, rank: int, steps: range) -> None:
    for step in steps:
        M.train_step(dmp, opt, M.make_batch(MODEL, seed=1000 * rank + step))


def _keyed_model(seed: int):
    """The fixture model with TorchRec's own dense optimizer: a KeyedOptimizerWrapper of Adam over the
    parameters the fused optimizers leave out (golden_training's pattern)."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dmp, _ = M.build_dmp(MODEL, PLAN, seed=seed)
    dense = {n: p for n, p in in_backward_optimizer_filter(dmp.named_parameters()) if p.requires_grad}
    return dmp, KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adam(params, lr=0.01))


def _save_chain(root: str, rank: int, quantization: dict) -> None:
    """A baseline and a delta of a trained model, written by the real Checkpointer."""
    from cnr_torchrec import Checkpointer

    dmp, opt = _keyed_model(seed=0)
    with Checkpointer(dmp, _config(root, quantization), dense_optimizer=opt, extra_state={"pos": Position(5)}) as ck:
        for step in (1, 2):
            _train(dmp, opt, rank, range(step * 10, step * 10 + 2))
            ck.save(step).wait()
    dist.barrier()


def _damage_every_payload(root: str, ckpt: int, stride: int = 512) -> None:
    """Flips one byte in every ``stride`` of checkpoint ``ckpt``'s rank files (rank 0 edits, all wait)."""
    if dist.get_rank() == 0:
        folder = os.path.join(root, f"ckpt-{ckpt:08d}")
        for name in sorted(os.listdir(folder)):
            if name.startswith("rank-") and name.endswith(".bin") and name != "rank-00000.bin":
                with open(os.path.join(folder, name), "r+b") as f:
                    data = bytearray(f.read())
                    for at in range(stride // 2, len(data), stride):
                        data[at] ^= 0xFF
                    f.seek(0)
                    f.write(data)
    dist.barrier()


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t)
    return int(t) > 0


def _failed_restore_worker(rank: int, world_size: int, root: str, quantization: dict) -> None:
    from cnr_torchrec import Checkpointer, CheckpointNotFoundError, RestoreFailedError

    _save_chain(root, rank, quantization)
    # Rank 1's files are damaged throughout; rank 0's are sound, so rank 0 applies its whole chain before the
    # ranks compare outcomes, then falls back to the baseline alone, which fails the same way: none restores.
    for ckpt in (0, 1):
        _damage_every_payload(root, ckpt)

    # A trained model (its own optimizer moments), an untrained one (no dense optimizer state at all: the restore
    # creates it, and the rollback must take it away again), and the control without rollback.
    for rollback, trained in ((True, True), (True, False), (False, True)):
        dmp, opt = _keyed_model(seed=3)  # another initialisation than the one saved
        if trained:
            _train(dmp, opt, rank, range(50, 53))
        pos = Position(99)
        before = M.local_state(dmp, opt)
        ck = Checkpointer(dmp, _config(root, quantization, restore_rollback=rollback), dense_optimizer=opt,
                          extra_state={"pos": pos})
        with pytest.raises(RestoreFailedError, match="none could be restored") as err:
            ck.restore()
        ck.close()
        assert not isinstance(err.value, CheckpointNotFoundError)
        # A residual chain is applied oldest copy first, so the damaged baseline (which every chain here needs) is
        # found first; a plain chain is applied newest first, so the delta is found, then the baseline alone.
        residual = quantization.get("residual", False)
        assert sorted(err.value.skipped) == ([0] if residual else [0, 1]), err.value.skipped
        assert all("rank-00001.bin" in why for why in err.value.skipped.values()), err.value.skipped
        after = M.local_state(dmp, opt)
        if rollback:
            M.assert_same(after, before, f"rank {rank}: the model after a failed restore (trained: {trained})")
            assert bool(opt.state) == trained
            assert pos.at == 99
            assert "as it was before restore()" in str(err.value)
        else:
            # The control: without the rollback the same restore did overwrite rows (rank 0's, at least).
            changed = any(not torch.equal(after[k], v) for k, v in before.items() if torch.is_tensor(v))
            assert _any_rank(changed), "the damaged chain was refused before any row was written: no test"
            assert "partly overwritten" in str(err.value)

    # No checkpoint at all: CheckpointNotFoundError, and nothing is touched.
    empty = os.path.join(root, "empty")
    dmp, opt = M.build_dmp(MODEL, PLAN, seed=3)
    before = M.local_state(dmp, opt)
    with Checkpointer(dmp, _config(empty), dense_optimizer=opt) as ck:
        with pytest.raises(CheckpointNotFoundError):
            ck.restore()
    M.assert_same(M.local_state(dmp, opt), before, "the model after restoring from an empty root")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("quantization", [PLAIN, RESIDUAL], ids=["fp32", "residual"])
def test_a_restore_that_fails_leaves_the_model_as_it_was(tmp_path, quantization):
    # Float32 host shards are restored into staged copies that reach the model only once every rank succeeded
    # (a residual chain's start from zero); their optimizer states and the rest are put back from a copy.
    run_ranks(_failed_restore_worker, 2, timeout=280, args=(str(tmp_path), quantization))


def _global_rngs() -> tuple[torch.Tensor, object, tuple]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _rng_worker(rank: int, world_size: int, root: str) -> None:
    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(MODEL, PLAN, seed=0)
    _train(dmp, opt, rank, range(2))
    _seed_all(11 + rank)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        ck.save(1).wait()
    saved_draws = (torch.rand(4), random.random(), float(np.random.rand()))  # what the saved RNGs give next
    dist.barrier()

    for restore_rng in (False, True):
        dmp, opt = M.build_dmp(MODEL, PLAN, seed=5)
        _seed_all(77 + rank)
        mine = _global_rngs()
        with Checkpointer(dmp, _config(root, restore_rng=restore_rng), dense_optimizer=opt) as ck:
            assert ck.restore() == 1
        if not restore_rng:
            now = _global_rngs()
            assert torch.equal(now[0], mine[0]) and now[1] == mine[1], "restore() moved the global RNGs"
            assert all(np.array_equal(a, b) for a, b in zip(now[2], mine[2])), "restore() moved NumPy's RNG"
        else:
            draws = (torch.rand(4), random.random(), float(np.random.rand()))
            assert torch.equal(draws[0], saved_draws[0]) and draws[1:] == saved_draws[1:], (draws, saved_draws)


@pytest.mark.timeout(240)
def test_restore_sets_the_global_rngs_only_when_asked(tmp_path):
    run_ranks(_rng_worker, 2, timeout=220, args=(str(tmp_path),))
