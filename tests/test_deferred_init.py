"""A model built with ``will_restore`` against the same model built eagerly by TorchRec.

TorchRec's TestSparseNN on 2 gloo ranks under plan "A" (shared tables, id-score tables, mixed dims, every EBC
sharding type, a data_parallel table), an EBC and an EC on meta, and TestMixedEmbeddingSparseArch (EBC and EC
with its dense part on the tables' device, meta or CPU), each built twice from the same seed: once as TorchRec
builds it (each kernel's ``init_parameters``, then each collection's ``reset_parameters``), once with
``CheckNRunDMP(will_restore=True)``:
- before anything needs them, the deferred model's fused tables hold no initial values (FBGEMM's zeros), so
  nothing was drawn; once materialised, every table shard, fused optimizer state and dense parameter equals
  the eager model's bit for bit, and the global generator is where the build left it;
- where TorchRec draws or loads over the tables as it builds the model (a dense part on meta, a module on the
  CPU), nothing is deferred, and the model equals the eager one;
- a restore into the deferred model gives the model a restore into the eager one gives, bit for bit (plain
  and residual chains), and leaves nothing to draw;
- a restore that fails (every checkpoint damaged), or finds nothing to restore, leaves the deferred model
  equal to the eager model as built: initialised, never zeros;
- the first forward, ``state_dict()`` and a save draw the values first: the same loss and the same
  checkpoint as the eager model's;
- the tables a warm start leaves fresh hold the eager build's initial values, and so do the slots of TorchRec's
  managed-collision EBC that a restore onto another world size relocates no raw id into;
- ``will_restore=<root>`` defers only when the root holds a committed checkpoint.
"""

from __future__ import annotations

import os

import _torchrec_models as M
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _format_checks import flip_bytes

pytestmark = pytest.mark.multirank

PLAIN = {"method": "none", "residual": False}
RESIDUAL = {"method": "adaptive", "bits": 4, "residual": True}


def _config(root: str, quantization: dict, **kw):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "quantization": quantization,
                        "keep": {"chains": 4}, **kw})


def _fused_weights(dmp) -> list[torch.Tensor]:
    tracker = dmp.dirty_tracker
    return [k.tbe.split_embedding_weights()[s.local_index] for t in tracker.tables()
            if not tracker.is_data_parallel(t) for k, s in tracker.shards(t)]


class _Collections(torch.nn.Module):
    """The "mixed" fixture's tables as an EBC and an EC on meta and nothing else (TestMixedEmbeddingSparseArch
    builds its dense part on the tables' device, which DMP then resets: see the mixed cases below)."""

    def __init__(self) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingCollection

        super().__init__()
        tables = M.tables_of("mixed").values()
        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection(tables=[t.config() for t in tables if t.kind != "ec"], device=meta)
        self.ec = EmbeddingCollection(tables=[t.config() for t in tables if t.kind == "ec"], device=meta)
        self.scale = torch.nn.Parameter(torch.ones(1))


def _build(model: str, seed: int, mixed_device: str, will_restore: bool):
    if model != "collections":
        return M.build_dmp(model, "A", seed=seed, mixed_device=mixed_device, will_restore=will_restore)
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP

    torch.manual_seed(seed)
    module = _Collections()
    dmp = CheckNRunDMP(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=M.build_plan(module, "mixed", "A", dist.get_world_size()), sharders=M.sharders(),
                       will_restore=will_restore)
    return dmp, torch.optim.SGD([dmp.module.scale], lr=0.1)


def _built_pair(model: str, seed: int, mixed_device: str = "meta"):
    """The eager and the deferred build of the same model from the same seed."""
    return _build(model, seed, mixed_device, False), _build(model, seed, mixed_device, True)


def _materialize_worker(rank: int, world_size: int, model: str, mixed_device: str) -> None:
    (eager, eager_opt), (deferred, deferred_opt) = _built_pair(model, 11, mixed_device)
    assert eager.deferred_init is None
    if model == "mixed":
        # On the CPU, TorchRec loads the unsharded module's rows over the initial ones as it shards it; on meta,
        # DMP resets the dense part after the tables: either way the recorded draws ran then, as the eager
        # build ran them, and nothing is left to defer.
        assert deferred.deferred_init is None
    else:
        assert deferred.deferred_init is not None and deferred.deferred_init.exact
        weights = _fused_weights(deferred)
        assert weights and all(not w.any() for w in weights), "a deferred table was filled as it was built"
        global_after_build = torch.random.get_rng_state()
        deferred.materialize_init()
        assert torch.equal(torch.random.get_rng_state(), global_after_build), "the replay moved the generator"
        assert deferred.deferred_init is None
    M.assert_same(M.local_state(deferred, deferred_opt), M.local_state(eager, eager_opt),
                  f"rank {rank}: {model} materialised against TorchRec's eager build")


@pytest.mark.parametrize("model,mixed_device", [("sparse_nn", "meta"), ("collections", "meta"), ("mixed", "meta"),
                                                ("mixed", "cpu")])
def test_materialized_tables_equal_torchrec_eager_build(model, mixed_device):
    run_ranks(_materialize_worker, 2, args=(model, mixed_device))


def _train_and_save(root: str, rank: int, quantization: dict) -> None:
    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp("sparse_nn", "A", seed=0)
    with Checkpointer(dmp, _config(root, quantization), dense_optimizer=opt) as ck:
        for step in (1, 2):
            for i in range(2):
                M.train_step(dmp, opt, M.make_batch("sparse_nn", seed=100 * rank + 10 * step + i))
            ck.save(step).wait()
    dist.barrier()


def _restore_worker(rank: int, world_size: int, root: str, quantization: dict) -> None:
    from cnr_torchrec import Checkpointer

    _train_and_save(root, rank, quantization)
    (eager, eager_opt), (deferred, deferred_opt) = _built_pair("sparse_nn", seed=5)
    restored = {}
    for name, (dmp, opt) in (("eager", (eager, eager_opt)), ("deferred", (deferred, deferred_opt))):
        with Checkpointer(dmp, _config(root, quantization), dense_optimizer=opt) as ck:
            assert ck.restore() == 2
        restored[name] = M.local_state(dmp, opt)
    assert deferred.deferred_init is None, "a whole restore leaves initial values to draw"
    M.assert_same(restored["deferred"], restored["eager"], f"rank {rank}: restored into a deferred model")
    # Training on continues alike: the restored rows are the weights (nothing is drawn over them later).
    for dmp, opt in ((eager, eager_opt), (deferred, deferred_opt)):
        M.train_step(dmp, opt, M.make_batch("sparse_nn", seed=900 + rank))
    M.assert_same(M.local_state(deferred, deferred_opt), M.local_state(eager, eager_opt),
                  f"rank {rank}: a step after the restore")


@pytest.mark.parametrize("quantization", [PLAIN, RESIDUAL], ids=["plain", "residual"])
def test_a_restore_into_a_deferred_model_equals_one_into_the_eager_model(tmp_path, quantization):
    run_ranks(_restore_worker, 2, args=(str(tmp_path / "root"), quantization,))


def _damage_rank1_files(root: str) -> None:
    if dist.get_rank() == 0:
        for d in sorted(os.listdir(root)):
            name = os.path.join(root, d, "rank-00001.bin")
            if d.startswith("ckpt-") and os.path.exists(name):
                flip_bytes(name)
    dist.barrier()


def _failed_restore_worker(rank: int, world_size: int, root: str, empty: str) -> None:
    from cnr_torchrec import Checkpointer, CheckpointNotFoundError, RestoreFailedError

    _train_and_save(root, rank, PLAIN)
    _damage_rank1_files(root)
    for where, error in ((root, RestoreFailedError), (empty, CheckpointNotFoundError)):
        (eager, eager_opt), (deferred, deferred_opt) = _built_pair("sparse_nn", seed=7)
        for dmp, opt in ((eager, eager_opt), (deferred, deferred_opt)):
            with Checkpointer(dmp, _config(where, PLAIN, on_corrupt="fallback"), dense_optimizer=opt) as ck:
                with pytest.raises(error):
                    ck.restore()
        assert deferred.deferred_init is None
        M.assert_same(M.local_state(deferred, deferred_opt), M.local_state(eager, eager_opt),
                      f"rank {rank}: after a restore from {where} that failed with {error.__name__}")


def test_a_failed_restore_leaves_the_deferred_model_as_torchrec_initialises_it(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run_ranks(_failed_restore_worker, 2, args=(str(tmp_path / "root"), str(empty),))


def _first_use_worker(rank: int, world_size: int, root: str) -> None:
    from cnr_torchrec import Checkpointer

    (eager, eager_opt), (deferred, deferred_opt) = _built_pair("sparse_nn", seed=3)
    batch = M.make_batch("sparse_nn", seed=rank)
    losses = [float(dmp(batch)[0].detach()) for dmp in (eager, deferred)]
    assert losses[0] == losses[1], losses
    assert deferred.deferred_init is None

    (eager, eager_opt), (deferred, deferred_opt) = _built_pair("sparse_nn", seed=4)
    states = [dmp.state_dict() for dmp in (eager, deferred)]
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        ours = [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]
        other = states[1][key]
        theirs = [s.tensor for s in other.local_shards()] if hasattr(other, "local_shards") else [other]
        assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs)), key

    (eager, eager_opt), (deferred, deferred_opt) = _built_pair("sparse_nn", seed=6)
    for name, (dmp, opt) in (("eager", (eager, eager_opt)), ("deferred", (deferred, deferred_opt))):
        with Checkpointer(dmp, _config(os.path.join(root, name), PLAIN), dense_optimizer=opt) as ck:
            ck.save(1).wait()
    rebuilt = []
    for name in ("eager", "deferred"):
        dmp, opt = M.build_dmp("sparse_nn", "A", seed=99)
        with Checkpointer(dmp, _config(os.path.join(root, name), PLAIN), dense_optimizer=opt) as ck:
            ck.restore()
        rebuilt.append(M.local_state(dmp, opt))
    M.assert_same(rebuilt[1], rebuilt[0], f"rank {rank}: a save before any restore")


def test_a_forward_a_state_dict_or_a_save_draws_the_initial_values_first(tmp_path):
    run_ranks(_first_use_worker, 2, args=(str(tmp_path),))


def _warm_start_worker(rank: int, world_size: int, root: str) -> None:
    from cnr_torchrec import warm_start

    _train_and_save(root, rank, PLAIN)
    (eager, eager_opt), (deferred, deferred_opt) = _built_pair("sparse_nn", seed=8)
    for dmp in (eager, deferred):
        report = warm_start(dmp, root, tables=["abc", "scored"])
        assert sorted(report.tables) == ["abc", "scored"], report
    assert deferred.deferred_init is None
    # The tables a warm start leaves fresh hold TorchRec's initial values, bit for bit as an eager build draws them.
    M.assert_same(M.local_state(deferred, deferred_opt), M.local_state(eager, eager_opt),
                  f"rank {rank}: a warm start of two tables into a deferred model")


def test_the_tables_a_warm_start_leaves_fresh_hold_torchrecs_initial_values(tmp_path):
    run_ranks(_warm_start_worker, 2, args=(str(tmp_path / "root"),))


def _mc_save_worker(rank: int, world_size: int, root: str) -> None:
    import _mc_models as MC

    from cnr_torchrec import CheckNRunDMP, Checkpointer

    model = MC.build_mc_model("ebc", world_size, dmp_cls=CheckNRunDMP, copy_initial=False)
    with Checkpointer(model.dmp, _config(root, PLAIN), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(MC.mc_batches(6, world_size, rank, seed=3, features=model.features), 1):
            MC.train_step(model, batch)
            if step % 3 == 0:
                ck.save(step).wait()


def _mc_relocated_worker(rank: int, world_size: int, root: str) -> None:
    import _mc_models as MC

    from cnr_torchrec import CheckNRunDMP, Checkpointer

    states = []
    for will_restore in (False, True):
        model = MC.build_mc_model("ebc", world_size, dmp_cls=CheckNRunDMP, copy_initial=False, seed=9,
                                  will_restore=will_restore)
        assert (model.dmp.deferred_init is not None) == will_restore
        with Checkpointer(model.dmp, _config(root, PLAIN), dense_optimizer=model.dense_optimizer) as ck:
            ck.restore(per_rank_state="drop")
        tracker = model.dmp.dirty_tracker
        states.append({(t, i): k.tbe.split_embedding_weights()[s.local_index].detach().clone()
                       for t in tracker.tables() for i, (k, s) in enumerate(tracker.shards(t))})
        assert model.dmp.deferred_init is None
    M.assert_same(states[1], states[0], f"rank {rank}: managed-collision slots relocated onto 2 ranks")


def test_a_managed_collision_restore_that_relocates_slots_leaves_the_empty_ones_initialised(tmp_path):
    """Saved by 1 rank, restored onto 2: the slots move by raw id, and the slots no raw id fills keep the model's
    initial values, the deferred model's equal to the eager one's."""
    root = str(tmp_path / "root")
    run_ranks(_mc_save_worker, 1, args=(root,))
    run_ranks(_mc_relocated_worker, 2, args=(root,))


def _root_worker(rank: int, world_size: int, root: str) -> None:
    from cnr_torchrec import Checkpointer

    os.makedirs(root, exist_ok=True)
    dmp, _ = M.build_dmp("sparse_nn", "A", seed=0, will_restore=root)
    assert dmp.deferred_init is None, "an empty root deferred the initial values"
    _train_and_save(root, rank, PLAIN)
    dmp, opt = M.build_dmp("sparse_nn", "A", seed=0, will_restore=root)
    assert dmp.deferred_init is not None, "a root with a committed checkpoint did not defer"
    with Checkpointer(dmp, _config(root, PLAIN), dense_optimizer=opt) as ck:
        ck.restore()
    assert dmp.deferred_init is None


def test_will_restore_a_root_defers_only_when_it_holds_a_checkpoint(tmp_path):
    run_ranks(_root_worker, 2, args=(str(tmp_path / "root"),))
