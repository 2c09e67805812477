"""Tracking and exact restore on TorchRec's own test models, fed by TorchRec's own input generators.

The fixtures (tests/_torchrec_models.py) are ``TestSparseNN`` (pooled and id-score tables of dims 4, 8
and 16) and ``TestMixedEmbeddingSparseArch`` (sequence tables beside a pooled one). Most of their
tables are shared by two or three features. Each model has two hand-built plans, and every table
but one changes sharding type between them; together they cover table_wise, row_wise, column_wise,
table_row_wise and data_parallel for EBC, and table_wise, row_wise and column_wise for EC
(data_parallel EC cannot run on CPU; _torchrec_models.py says why).

The references are independent of the tracker: the TBE weights and optimizer states diffed around
each step, and the ids read from the ModelInput batches' KJTs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks

pytestmark = pytest.mark.multirank


# ----------------------------------------------------------------------------- (a) tracked rows


def _snapshot(tracker, table):
    """Per shard on this rank: (global row ids, weight rows, optimizer-state rows), copied now."""
    out = []
    for kernel, shard in tracker.shards(table):
        w = kernel.tbe.split_embedding_weights()[shard.local_index].detach().clone()
        states = []
        if not tracker.is_data_parallel(table):  # the dense optimizer holds a replicated table's state
            states = [s.detach().clone().reshape(shard.num_rows, -1)
                      for s in kernel.tbe.split_optimizer_states()[shard.local_index]]
        out.append((torch.arange(*shard.rows), w, states))
    return out


def _changed_rows(before, after):
    """Global ids of the rows whose weights, and of those whose optimizer state, differ."""
    weights, states = [torch.empty(0, dtype=torch.int64)], [torch.empty(0, dtype=torch.int64)]
    for (rows, w0, s0), (_, w1, s1) in zip(before, after):
        weights.append(rows[(w0 != w1).any(dim=1)])
        states += [rows[(a != b).any(dim=1)] for a, b in zip(s0, s1)]
    return torch.unique(torch.cat(weights)), torch.unique(torch.cat(states))


def _held(tracker, table, ids):
    """The ids that fall in a row range this rank holds of ``table``."""
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for (r0, r1), _ in tracker.shard_ranges(table):
        keep |= (ids >= r0) & (ids < r1)
    return ids[keep]


def _tracking_worker(rank, world_size, model, plan, variable_batch):
    import _torchrec_models as M

    dmp, opt = M.build_dmp(model, plan)
    tracker = dmp.dirty_tracker
    tables = M.tables_of(model)
    assert sorted(tracker.tables()) == sorted(tables)
    assert {t: tracker.sharding_type(t) for t in tables} == {t: spec.plans[plan] for t, spec in tables.items()}
    compared = unchanged = 0
    for step in range(3):
        batch = M.make_batch(model, seed=1000 * step + rank, variable_batch=variable_batch)
        if variable_batch:  # the generator did vary the batch size per feature
            assert len(set(batch.idlist_features.stride_per_key())) > 1
        present = M.batch_ids(model, batch)
        # Bags no sample points back to get a zero gradient: looked up (and marked) but unchanged.
        referenced = M.batch_ids(model, batch, referenced_only=True) if variable_batch else present
        before = {t: _snapshot(tracker, t) for t in tables}
        M.train_step(dmp, opt, batch)
        for t, spec in tables.items():
            tracked = tracker.dirty_rows(t)
            changed_w, changed_s = _changed_rows(before[t], _snapshot(tracker, t))
            if tracker.is_data_parallel(t):
                # Replicated tables are saved whole; the dense optimizer (Adam) moves, on its first
                # step, exactly the rows some rank's batch looked up (DDP averages the gradients).
                assert torch.equal(tracked, torch.arange(spec.rows)), t
                if step == 0:
                    assert torch.equal(changed_w, present[t]), (t, changed_w.tolist(), present[t].tolist())
                continue
            # Rows marked = the batch's ids of this table (every feature, every rank) that this rank holds.
            expected = _held(tracker, t, present[t])
            assert torch.equal(tracked, expected), (t, step, tracked.tolist(), expected.tolist())
            assert tracker.dirty_counts()[t] == tracked.numel()
            assert set(changed_w.tolist()) <= set(tracked.tolist()), (t, step)
            assert set(changed_s.tolist()) <= set(tracked.tolist()), (t, step)
            if variable_batch:
                unchanged += tracked.numel() - changed_w.numel()
            # Every row of a bag that reaches the loss gets a nonzero gradient, and row-wise Adagrad then
            # moves both its weights and its state.
            moved = _held(tracker, t, referenced[t])
            assert torch.equal(changed_w, moved), (t, step, changed_w.tolist(), moved.tolist())
            assert torch.equal(changed_s, moved), (t, step)
            compared += changed_w.numel()
        tracker.reset()
    assert compared > 0  # the comparisons were not vacuous on this rank
    if variable_batch:  # and the variable batch did leave looked-up rows unchanged
        assert unchanged > 0


TRACKING_CASES = [
    ("sparse_nn", "A", False),
    ("sparse_nn", "B", False),
    ("mixed", "A", False),
    ("mixed", "B", False),
    # Variable batch size per feature (KJT with stride_per_key_per_rank and inverse_indices, from
    # torchrec's VariableBatchModelInput). On CPU, torchrec's EBC runs it for table_wise and
    # column_wise only: row_wise and table_row_wise fail in the backward of the reduce-scatter-v
    # output dist ("ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (72), got
    # (96))": gloo's all_gather needs equal sizes), and data_parallel fails in the dense TBE forward
    # ("Index 71 is out of bounds: 46, range 0 to 40"). Both fail with plain DistributedModelParallel too.
    ("sparse_nn", "VBE", True),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("model,plan,variable_batch", TRACKING_CASES,
                         ids=[f"{m}-{p}" for m, p, _ in TRACKING_CASES])
def test_tracked_rows_are_the_rows_each_step_changed(model, plan, variable_batch):
    run_ranks(_tracking_worker, world_size=2, timeout=150, args=(model, plan, variable_batch))


# ----------------------------------------------------------------------------- (b) exact fp32 restore


def _config(root):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "quantization": {"method": "none", "bits": None}})


def _dense_state(dmp, opt):
    """Dense parameters and buffers by name (everything in local_state that is not a table shard)."""
    import _torchrec_models as M

    return {k: v for k, v in M.local_state(dmp, opt).items() if isinstance(k, str)}


def _save_worker(rank, world_size, root, model, plan, ref_path, restore_same_plan):
    """Trains and saves a chain (baseline + 2 deltas); writes whole tables and dense state at the last
    save; then, optionally, restores onto a fresh model under the same plan and compares every shard."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, plan)
    ckpt = Checkpointer(dmp, _config(root), dense_optimizer=opt)
    kinds = []
    for step in range(1, 4):
        M.train_step(dmp, opt, M.make_batch(model, seed=100 * step + 10 * world_size + rank))
        kinds.append(ckpt.save(step).wait().kind)
    assert kinds == ["baseline", "delta", "delta"]
    ckpt.close()
    saved = M.local_state(dmp, opt)
    tables = M.full_tables(dmp, model)
    if rank == 0:
        torch.save({"tables": {t: (w, m) for t, (w, m, _) in tables.items()},
                    "dense": {k: v for k, v in saved.items() if isinstance(k, str)},
                    "dense_optimizer": M.dense_optimizer_state(dmp, opt)}, ref_path)
    dist.barrier()
    if not restore_same_plan:
        return

    fresh, opt2 = M.build_dmp(model, plan, seed=1)
    before = M.local_state(fresh, opt2)
    assert any(not torch.equal(before[k], saved[k]) for k in saved if isinstance(k, tuple) and k[-1] == "w")
    assert Checkpointer(fresh, _config(root), dense_optimizer=opt2).restore() == 3
    # Every shard's weights and fused optimizer states, the dense parameters and buffers, and the
    # dense optimizer's state, bit for bit.
    M.assert_same(M.local_state(fresh, opt2), saved, "same plan")


def _restore_worker(rank, world_size, root, model, plan, ref_path):
    """Restores onto another plan and world size and compares whole tables with the live ones at save time."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, plan, seed=5)
    ref = torch.load(ref_path, weights_only=True)
    before = M.full_tables(dmp, model)
    assert any(not torch.equal(before[t][0], ref["tables"][t][0]) for t in before)
    # The dense optimizer follows its parameters by name across plans: checked on its own in
    # test_dense_optimizer_state_follows_its_parameters_across_plans.
    assert Checkpointer(dmp, _config(root)).restore() == 3
    got = M.full_tables(dmp, model)
    specs = M.tables_of(model)
    for t, (w, m, dp) in got.items():
        want_w, want_m = ref["tables"][t]
        assert torch.equal(w, want_w), (t, (w - want_w).abs().max())
        if dp:  # a replicated table keeps no row-wise state
            continue
        if "column_wise" in specs[t].plans.values():
            # Whole-row state from column shards is a weighted mean, computed here in float64.
            torch.testing.assert_close(m, want_m, rtol=1e-6, atol=0, msg=t)
        else:
            assert torch.equal(m, want_m), (t, (m - want_m).abs().max())
    M.assert_same(_dense_state(dmp, opt), ref["dense"], "dense parameters")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["sparse_nn", "mixed"])
def test_fp32_restore_is_exact_on_the_same_and_on_other_plans(tmp_path, model):
    two, one = str(tmp_path / "from2"), str(tmp_path / "from1")
    ref2, ref1 = str(tmp_path / "ref2.pt"), str(tmp_path / "ref1.pt")
    run_ranks(_save_worker, world_size=2, timeout=100, args=(two, model, "A", ref2, True))
    run_ranks(_restore_worker, world_size=1, timeout=100, args=(two, model, "B", ref2))  # 2 ranks -> 1
    run_ranks(_save_worker, world_size=1, timeout=100, args=(one, model, "B", ref1, False))
    run_ranks(_restore_worker, world_size=2, timeout=100, args=(one, model, "A", ref1))  # 1 rank -> 2


def _dense_optimizer_worker(rank, world_size, root, model, ref_path):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer, IncompatibleCheckpointError

    dmp, opt = M.build_dmp(model, "B", seed=5)
    ref = torch.load(ref_path, weights_only=True)["dense_optimizer"]
    try:
        Checkpointer(dmp, _config(root), dense_optimizer=opt).restore()
    except IncompatibleCheckpointError as e:  # a named refusal that says why is acceptable too
        assert "optimizer" in str(e), e
        return
    got = M.dense_optimizer_state(dmp, opt)
    for name, state in got.items():
        if name in ref:  # in the dense optimizer under both plans: its own state, exactly
            M.assert_same(state, ref[name], f"dense optimizer state of {name}")
        param = dict(dmp.named_parameters())[name]
        for key, value in state.items():
            assert not torch.is_tensor(value) or value.dim() == 0 or value.shape == param.shape, (
                f"dense optimizer state {key!r} of {name} {tuple(param.shape)} has shape {tuple(value.shape)}")
    M.train_step(dmp, opt, M.make_batch(model, seed=77))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("model", ["sparse_nn", "mixed"])
def test_dense_optimizer_state_follows_its_parameters_across_plans(tmp_path, model):
    root, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    run_ranks(_save_worker, world_size=2, timeout=100, args=(root, model, "A", ref, False))
    run_ranks(_dense_optimizer_worker, world_size=1, timeout=100, args=(root, model, ref))


# ----------------------------------------------------------------------------- (c) managed collision


def _zch_sparse_nn(world_size, mc_type, seed=0):
    """TorchRec's own ZCH variant of TestSparseNN: a ManagedCollisionEmbeddingBagCollection whose managed-collision
    module (``mc_type``: "sort-zch" or "mp-zch") remaps raw ids below 4000 into a 64-row table two features share,
    in a CheckNRunDMP with fused EXACT_SGD (row-wise Adagrad's evictions have no CPU kernel), and a dense optimizer."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.test_utils.table_config import ManagedCollisionConfig
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from cnr_torchrec import CheckNRunDMP

    torch.manual_seed(seed)
    tables, weighted = _zch_tables(64)
    zch = ManagedCollisionConfig(mc_type=mc_type, input_hash_size=ZCH_IDS, total_num_buckets=world_size)
    model = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=6,
                         dense_device=torch.device("cpu"), sparse_device=torch.device("meta"),
                         zch_kwargs={t.name: zch for t in tables + weighted})
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05}
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params=fused))
    plan = {}
    for fqn, module, configs in (("sparse.ebc", model.sparse.ebc, tables),
                                 ("sparse.weighted_ebc", model.sparse.weighted_ebc, weighted)):
        plan[fqn] = construct_module_sharding_plan(module, {t.name: row_wise(compute_kernel="fused") for t in configs},
                                                   sharder=sharder, local_size=world_size, world_size=world_size,
                                                   device_type="cpu")
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=ShardingPlan(plan), sharders=[sharder])
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.SGD(dense, lr=0.05)


ZCH_IDS = 4000


def _zch_tables(rows):
    """The ZCH model's tables, ``rows`` each: one two features share, and a weighted one of its own."""
    from torchrec import EmbeddingBagConfig

    return ([EmbeddingBagConfig(name="zch_shared", num_embeddings=rows, embedding_dim=8, feature_names=["f_u", "f_i"])],
            [EmbeddingBagConfig(name="zch_weighted", num_embeddings=rows, embedding_dim=4, feature_names=["f_w"])])


def _zch_batch(seed):
    """TorchRec's ModelInput over raw ids below ``ZCH_IDS`` (the table configs it draws from say so)."""
    import random

    from torchrec.distributed.test_utils.model_input import ModelInput

    torch.manual_seed(seed)
    random.seed(seed)
    tables, weighted = _zch_tables(ZCH_IDS)
    return ModelInput.generate(batch_size=8, tables=tables, weighted_tables=weighted, num_float_features=6,
                               pooling_avg=3)


def _zch_worker(rank, world_size, root):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer, load_config

    dmp, opt = _zch_sparse_nn(world_size, "sort-zch")
    config = load_config({"root": root})  # the default: consecutive, residual 4-bit
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in range(1, 9):
            M.train_step(dmp, opt, _zch_batch(100 * step + rank))
            if step % 4 == 0:
                ck.save(step).wait()
        assert ck.config.quantization.residual is True
        live = {t: _zch_rows(ck.tracker, t) for t in ("zch_shared", "zch_weighted")}
        # TestSparseNN's sort-zch modules evict every 1000 steps: here the table is still empty, and the
        # eviction window's history holds every id seen so far (the state_dict does not).
        assert all(_window(ck.tracker, t)[0].numel() > 50 for t in live)
        window = {t: _window(ck.tracker, t) for t in live}

    other, opt2 = _zch_sparse_nn(world_size, "sort-zch", seed=3)
    with Checkpointer(other, config, dense_optimizer=opt2) as ck:
        assert ck.restore() == 8
        for table, (mc, weights) in live.items():
            mc2, restored = _zch_rows(ck.tracker, table)
            # The remapping exactly; the weights as 4-bit residuals give them back.
            assert torch.equal(mc2, mc), table
            span = (weights.max(dim=1).values - weights.min(dim=1).values).clamp_min(1e-6)
            assert bool(((restored - weights).abs().max(dim=1).values <= span / 8).all()), table
            history, counters = _window(ck.tracker, table)
            assert torch.equal(history, window[table][0]) and counters == window[table][1], table
        M.train_step(other, opt2, _zch_batch(999 + rank))


def _window(tracker, table):
    """This rank's eviction window of ``table``: the raw ids seen since the last eviction, and the counters."""
    mch = tracker.mc_table(table).mch
    n = mch._current_history_buffer_offset
    return mch._history_accumulator[:n].clone(), (mch._current_iter, mch._last_eviction_iter)


def _zch_rows(tracker, table):
    """This rank's by-row remapping state and weights of ``table``."""
    (kernel, shard), = tracker.shards(table)
    weights = kernel.tbe.split_embedding_weights()[shard.local_index].detach().clone()
    return tracker.mc_table(table).by_row(), weights


@pytest.mark.timeout(150)
def test_torchrecs_zch_sparse_nn_is_checkpointed_and_restored_with_its_remapping(tmp_path):
    run_ranks(_zch_worker, world_size=2, timeout=120, args=(str(tmp_path / "ck"),))


def _mp_zch_worker(rank, world_size):
    from cnr_torchrec import UnsupportedShardingError

    with pytest.raises(UnsupportedShardingError, match="HashZchManagedCollisionModule") as err:
        _zch_sparse_nn(world_size, "mp-zch")
    assert "zch_shared" in str(err.value) and "sort-zch" in str(err.value)


@pytest.mark.timeout(150)
def test_mp_zch_tables_are_refused_by_name():
    run_ranks(_mp_zch_worker, world_size=2, timeout=100)


# ----------------------------------------------------------------------------- (d) uneven column shards


UNEVEN = ("abc", "pair")  # the tables plan "UNEVEN" cuts into column shards of widths 4 and 12


def _uneven_worker(rank, world_size, root):
    """One step from the same weights and batches under two plans: uneven column shards (saved), and every
    table whole (the reference). Row-wise Adagrad keeps, per row of a shard, the mean of the squared
    gradients over the shard's columns (FBGEMM's definition); a table kept whole keeps it over all of its
    columns. The saved column shards restored onto the whole tables must give the whole tables' values."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    batch = M.make_batch("sparse_nn", seed=70 + rank)
    whole, whole_opt = M.build_dmp("sparse_nn", "TW", seed=0)
    start = M.full_tables(whole, "sparse_nn")
    M.train_step(whole, whole_opt, batch)
    want = M.full_tables(whole, "sparse_nn")

    dmp, opt = M.build_dmp("sparse_nn", "UNEVEN", seed=0)  # the same dense layers (seed); TBEs draw their own
    with torch.no_grad():  # so the shards start from the whole tables' weights
        for t, (w, _, _) in start.items():
            for kernel, s in dmp.dirty_tracker.shards(t):
                kernel.tbe.split_embedding_weights()[s.local_index].copy_(w[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]])
    for t in UNEVEN:
        dim = M.tables_of("sparse_nn")[t].dim
        widths = [c1 - c0 for _, s in dmp.dirty_tracker.shards(t) for c0, c1 in [s.cols]]
        assert widths == [dim // 4 if rank == 0 else dim - dim // 4], (t, widths)
    M.train_step(dmp, opt, batch)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        ck.save(1).wait()

    fresh, fresh_opt = M.build_dmp("sparse_nn", "TW", seed=1)
    with Checkpointer(fresh, _config(root), dense_optimizer=fresh_opt) as ck:
        assert ck.restore() == 1
    got = M.full_tables(fresh, "sparse_nn")
    for t in UNEVEN:
        assert not torch.equal(want[t][1], torch.zeros_like(want[t][1])), t  # the step reached the table
        torch.testing.assert_close(got[t][1], want[t][1], rtol=1e-6, atol=0, msg=lambda m: f"{t}: {m}")
    if rank == 0:  # the offline assembly (cnr export, compaction, warm start) merges the column shards the same way
        from cnr_torchrec.ckpt.format.bytes.storage import Storage
        from cnr_torchrec.ckpt.tools.export import export_state_dict

        storage = Storage(root)
        exported = export_state_dict(storage)
        storage.close()
        fqns = {k.removesuffix(".weight").rsplit(".", 1)[-1]: k for k in exported if k.endswith(".weight")}
        for t in UNEVEN:
            torch.testing.assert_close(exported[f"{fqns[t]}.optimizer_state.0"], want[t][1].float(), rtol=1e-6, atol=0,
                                       msg=lambda m: f"{t}: {m}")


@pytest.mark.timeout(200)
def test_row_wise_state_of_uneven_column_shards_restores_onto_whole_tables(tmp_path):
    run_ranks(_uneven_worker, world_size=2, timeout=170, args=(str(tmp_path / "root"),))
