"""DirtyRowTracker on 2 gloo ranks, against weights diffed before and after each step
and against torchrec's own ModelDeltaTracker (ID_ONLY)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

from _dist import run_ranks

pytestmark = pytest.mark.multirank

ROWS, DIM = 48, 8


def _specs():
    from examples.toy import SHARDING_TYPES, TableSpec

    ebc = [TableSpec(f"b_{st}", ROWS, DIM, st, "ebc") for st in SHARDING_TYPES]
    # torchrec's EmbeddingCollection has no table_row_wise sharding, and its data_parallel
    # path on CPU pools sequences (the dense TBE ignores pooling=NONE), so it cannot run here.
    ec = [TableSpec(f"e_{st}", ROWS, DIM, st, "ec") for st in SHARDING_TYPES
          if st not in ("table_row_wise", "data_parallel")]
    return ebc + ec


def _build(world_size, optimizer, **tracker_kwargs):
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from examples.toy import ToyModel, build_plan, sharders_for

    torch.manual_seed(0)
    specs = _specs()
    model = ToyModel(specs)
    sharders = sharders_for(optimizer, lr=0.05)
    plan = build_plan(model, sharders, world_size)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=plan, sharders=sharders, **tracker_kwargs)
    return dmp, specs


def _snapshot(tracker, table):
    """Per shard: (global row ids, weight rows, optimizer-state rows) copied now."""
    out = []
    for kernel, shard in tracker.shards(table):
        w = kernel.tbe.split_embedding_weights()[shard.local_index].detach().clone()
        states = []
        all_states = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
        if all_states:  # EXACT_SGD keeps no state
            states = [s.detach().clone().reshape(shard.num_rows, -1) for s in all_states[shard.local_index]]
        out.append((torch.arange(*shard.rows), w, states))
    return out


def _changed_rows(before, after):
    weights, states = [], []
    for (rows, w0, s0), (_, w1, s1) in zip(before, after):
        weights.append(rows[(w0 != w1).any(dim=1)])
        for a, b in zip(s0, s1):
            states.append(rows[(a != b).any(dim=1)])
    cat = lambda xs: torch.unique(torch.cat(xs)) if xs else torch.empty(0, dtype=torch.int64)  # noqa: E731
    return cat(weights), cat(states)


def _mdt_global_ids(mdt, tracker):
    """ModelDeltaTracker ids (local to each shard) mapped to global row ids, per table."""
    got = {}
    for fqn, ids in mdt.get_unique_ids().items():
        table = fqn.split(".")[-2] if fqn.endswith(".weight") else fqn.split(".")[-1]
        shards = tracker.shard_ranges(table)
        # Every shard of a table on one rank starts at the same row (column shards).
        got[table] = torch.unique(ids.cpu().long() + shards[0][0][0])
    return got


def _equality_worker(rank, world_size, optimizer_name):
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    from examples.toy import zipf_batch

    dmp, specs = _build(world_size, EmbOptimType[optimizer_name])
    tracker = dmp.dirty_tracker
    mdt = dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY))
    dense_params = [p for n, p in dmp.named_parameters() if "dense" in n or "_dp" in n or "data_parallel" in n]
    dense_opt = torch.optim.SGD(dense_params, lr=0.05)
    assert set(tracker.tables()) == {s.name for s in specs}
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        before = {t: _snapshot(tracker, t) for t in tracker.tables()}
        loss = dmp(zipf_batch(specs, batch_size=6, pooling=3, generator=gen, alpha=0.5))
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        mdt_ids = _mdt_global_ids(mdt, tracker)
        sharded_dirty = 0
        for t in tracker.tables():
            tracked = tracker.dirty_rows(t)
            changed_w, changed_s = _changed_rows(before[t], _snapshot(tracker, t))
            held = [r for r, _ in tracker.shard_ranges(t)]
            if tracker.is_data_parallel(t):
                assert torch.equal(tracked, torch.arange(ROWS)), t
                assert set(changed_w.tolist()) <= set(tracked.tolist()), t
                continue
            if not held:
                assert tracked.numel() == 0, t
                continue
            assert torch.equal(tracked, changed_w), (t, step, tracked.tolist(), changed_w.tolist())
            sharded_dirty += tracked.numel()
            if optimizer_name == "EXACT_ROWWISE_ADAGRAD":
                assert torch.equal(tracked, changed_s), (t, step)
            assert tracker.dirty_counts()[t] == tracked.numel()
            assert torch.equal(tracked, mdt_ids.get(t, torch.empty(0, dtype=torch.int64))), (t, step)
        assert sharded_dirty > 0  # the comparison above was not vacuous
        tracker.reset()
        assert all(n == 0 for t, n in tracker.dirty_counts().items() if not tracker.is_data_parallel(t))

    # Eval mode and no_grad forwards mark nothing.
    batch = zipf_batch(specs, batch_size=6, pooling=3, generator=gen)
    dmp.eval()
    dmp(batch)
    dmp.train()
    with torch.no_grad():
        dmp(batch)
    assert all(n == 0 for t, n in tracker.dirty_counts().items() if not tracker.is_data_parallel(t))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["EXACT_ROWWISE_ADAGRAD", "EXACT_SGD"])
def test_tracked_rows_equal_changed_rows_and_model_delta_tracker(optimizer):
    run_ranks(_equality_worker, world_size=2, timeout=240, args=(optimizer,))


def _counts_baseline_errors_worker(rank, world_size):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


    from cnr_torchrec import DirtyRowTracker, MalformedLookupError, RowIdOutOfRangeError
    from examples.toy import zipf_batch

    dmp, specs = _build(world_size, EmbOptimType.EXACT_ROWWISE_ADAGRAD, count_updates=True, baseline_view=True)
    tracker = dmp.dirty_tracker
    assert tracker.bits_per_row == pytest.approx(1 + 1 + 32, rel=0.1)
    gen = torch.Generator().manual_seed(7 + rank)
    per_step = []  # per step: {table: lookups of each row over the global batch}
    for step in range(3):
        batch = zipf_batch(specs, batch_size=5, pooling=4, generator=gen)
        jts = batch.to_dict()
        counts = {}
        for t in tracker.tables():
            # Every rank's ids reach the shards that own them: count over the gathered batch.
            ids = jts[f"{t}_f"].values()
            gathered = [torch.zeros_like(ids) for _ in range(world_size)]
            dist.all_gather(gathered, ids)
            counts[t] = torch.bincount(torch.cat(gathered), minlength=ROWS)
        per_step.append(counts)
        dmp(batch).backward()
        if step == 0:
            tracker.reset(baseline=True)  # a baseline was taken after step 0
        elif step == 1:
            step1 = {t: tracker.dirty_rows(t) for t in tracker.tables()}
            tracker.reset()
    checked = 0
    for t in tracker.tables():
        held = [r for r, _ in tracker.shard_ranges(t)]
        if tracker.is_data_parallel(t) or not held:
            continue
        mask = torch.zeros(ROWS, dtype=torch.bool)
        for r0, r1 in held:
            mask[r0:r1] = True
        since_baseline = torch.nonzero(((per_step[1][t] + per_step[2][t]) > 0) & mask).flatten()
        assert torch.equal(tracker.dirty_rows(t, since_baseline=True), since_baseline), t
        # The per-interval view holds step 2 only; with step 1's rows it is the baseline view.
        assert torch.equal(torch.unique(torch.cat([step1[t], tracker.dirty_rows(t)])), since_baseline), t
        # Counters cover the interval since the last reset (step 2); each column shard sees every lookup.
        rows, counts = tracker.update_counts(t)
        assert torch.equal(counts.long(), per_step[2][t][rows]), t
        checked += int(counts.sum())
    assert checked > 0

    # An id outside its table is a named error naming the table. Both ranks hold a column
    # shard of b_column_wise, so both fail at the same lookup and no collective is left waiting.
    bad = zipf_batch(specs, batch_size=2, pooling=1, generator=gen)
    values = bad.values().clone()
    values[bad.keys().index("b_column_wise_f") * 2] = ROWS + 5
    bad = KeyedJaggedTensor(keys=bad.keys(), values=values, lengths=bad.lengths())
    with pytest.raises(RowIdOutOfRangeError, match="b_column_wise"):
        dmp(bad)

    # The marking pass is the lookup's bounds check: FBGEMM's own is off for the lookups the
    # tracker marks, on for the others, and back as configured once the tracker is removed.
    (kernel, _), *_ = tracker.shards("b_column_wise")
    tbe = kernel.tbe
    configured = BoundsCheckMode.WARNING.value  # FBGEMM's default, which torchrec keeps
    seen = []
    probe = tbe.register_forward_pre_hook(lambda m, a, kw: seen.append(m.bounds_check_mode_int), with_kwargs=True)
    T = len(tbe.feature_table_map)
    ok = dict(indices=torch.zeros(T, dtype=torch.int64), offsets=torch.arange(T + 1, dtype=torch.int64))
    with torch.no_grad():
        tbe(**ok)
    tbe(**ok)
    with torch.no_grad():
        tbe(**ok)
    assert seen == [configured, BoundsCheckMode.NONE.value, configured]
    # A training lookup leaves the mode at NONE; a second tracker must not take that for the configured one.
    tbe(**ok)
    second = DirtyRowTracker(dmp)
    late = []
    probe_late = tbe.register_forward_pre_hook(lambda m, a, kw: late.append(m.bounds_check_mode_int),
                                               with_kwargs=True)
    with torch.no_grad():
        tbe(**ok)
    assert late == [configured]
    probe_late.remove()
    second.remove()
    # So the pass rejects what FBGEMM's check would catch, before the lookup reads it.
    backwards = dict(indices=ok["indices"], offsets=ok["offsets"].flip(0))
    with pytest.raises(MalformedLookupError, match="never decrease"):
        tbe(**backwards)
    with pytest.raises(MalformedLookupError, match="per-sample weights"):
        tbe(**ok, per_sample_weights=torch.ones(T + 1))
    # A lookup the tracker does not mark keeps FBGEMM's behaviour: WARNING mode zeroes a bad id in place.
    with torch.no_grad():
        wild = torch.full((T,), ROWS + 5, dtype=torch.int64)
        tbe(indices=wild, offsets=ok["offsets"])
    assert not wild.any()
    probe.remove()
    tracker.remove()
    assert tbe.bounds_check_mode_int == configured


def _unsupported_kernel_worker(rank, world_size):
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP, UnsupportedShardingError
    from examples.toy import TableSpec, ToyModel, build_plan, sharders_for

    # A sharded table on the dense compute kernel cannot be tracked: named error listing it.
    specs = [TableSpec("ok", ROWS, DIM, "row_wise"), TableSpec("dense_rw", ROWS, DIM, "row_wise")]
    model = ToyModel(specs)
    sharders = sharders_for()
    plan = build_plan(model, sharders, world_size)
    plan.plan["ebc"]["dense_rw"].compute_kernel = "dense"
    with pytest.raises(UnsupportedShardingError, match="dense_rw"):
        CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                     plan=plan, sharders=sharders)


@pytest.mark.timeout(200)
def test_counts_baseline_view_and_out_of_range_id():
    run_ranks(_counts_baseline_errors_worker, world_size=2, timeout=150)


@pytest.mark.timeout(200)
def test_unsupported_compute_kernel_is_named():
    run_ranks(_unsupported_kernel_worker, world_size=2, timeout=150)


def _pipeline_worker(rank, world_size):
    from torch import nn
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from examples.toy import TableSpec, ToyModel, build_plan, sharders_for, zipf_batch

    class PipelineModel(nn.Module):
        def __init__(self, toy):
            super().__init__()
            self.toy = toy

        def forward(self, batch):
            loss = self.toy(batch.sparse_features)
            return loss, loss.detach()

    specs = [TableSpec(f"p_{st}", ROWS, DIM, st) for st in ("table_wise", "row_wise", "column_wise")]
    torch.manual_seed(0)
    toy = ToyModel(specs)
    sharders = sharders_for()
    plan = build_plan(toy, sharders, world_size)
    from torchrec.distributed.types import ShardingPlan

    plan = ShardingPlan({f"toy.{k}": v for k, v in plan.plan.items()})
    dmp = CheckNRunDMP(PipelineModel(toy), env=ShardingEnv.from_process_group(dist.group.WORLD),
                       device=torch.device("cpu"), plan=plan, sharders=sharders)
    tracker = dmp.dirty_tracker
    gen = torch.Generator().manual_seed(11 + rank)
    batches = [
        Batch(dense_features=torch.zeros(4, 1), sparse_features=zipf_batch(specs, 4, 3, gen),
              labels=torch.zeros(4))
        for _ in range(4)
    ]
    before = {t: _snapshot(tracker, t) for t in tracker.tables()}
    pipeline = TrainPipelineSparseDist(dmp, torch.optim.SGD(dmp.module.toy.dense.parameters(), lr=0.1),
                                       torch.device("cpu"))
    it = iter(batches)
    steps = 0
    while True:
        try:
            pipeline.progress(it)
            steps += 1
        except StopIteration:
            break
    assert steps == len(batches)
    dirty = 0
    for t in tracker.tables():
        changed, _ = _changed_rows(before[t], _snapshot(tracker, t))
        assert torch.equal(tracker.dirty_rows(t), changed), t
        dirty += changed.numel()
    assert dirty > 0


@pytest.mark.timeout(200)
def test_tracking_under_train_pipeline_sparse_dist():
    run_ranks(_pipeline_worker, world_size=2, timeout=150)


def _takeover_options_worker(rank, world_size):
    import os

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from cnr_torchrec.errors import RowIdOutOfRangeError
    from examples.toy import TableSpec, ToyModel, build_plan, sharders_for, zipf_batch

    specs = [TableSpec(f"o_{st}", ROWS, DIM, st) for st in ("row_wise", "table_wise", "column_wise")]

    def build(sharders=None, **kwargs):
        torch.manual_seed(0)
        model = ToyModel(specs)
        sharders = sharders or sharders_for()
        plan = build_plan(model, sharders, world_size)
        return CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                            plan=plan, sharders=sharders, **kwargs)

    def modes_seen_in_training(dmp) -> set[int]:
        """FBGEMM's bounds-check mode as each TBE runs a training lookup (read after our pre-hook)."""
        seen, probes = set(), []
        for tbe in dmp.dirty_tracker.tbes():
            # Registered after the tracker's hook, so it sees the mode the lookup runs with.
            probes.append(tbe.register_forward_pre_hook(lambda m, a, kw: seen.add(m.bounds_check_mode_int),
                                                        with_kwargs=True))
        dmp(zipf_batch(specs, 4, 2, torch.Generator().manual_seed(rank))).backward()
        for p in probes:
            p.remove()
        return seen

    def out_of_range_batch():
        # Both ranks hold a column shard of o_column_wise, so both fail at the same lookup.
        batch = zipf_batch(specs, 2, 1, torch.Generator().manual_seed(3))
        values = batch.values().clone()
        values[batch.keys().index("o_column_wise_f") * 2] = ROWS + 7
        return type(batch)(keys=batch.keys(), values=values, lengths=batch.lengths())

    warning, fatal, none = (BoundsCheckMode.WARNING.value, BoundsCheckMode.FATAL.value, BoundsCheckMode.NONE.value)
    # Default: the marking pass stands in for FBGEMM's check of training lookups.
    dmp = build()
    assert dmp.dirty_tracker.fused_bounds_check and modes_seen_in_training(dmp) == {none}
    # Switched off: FBGEMM checks as configured, and the marking pass still rejects bad ids by name.
    dmp = build(fuse_bounds_check=False)
    assert not dmp.dirty_tracker.fused_bounds_check and modes_seen_in_training(dmp) == {warning}
    with pytest.raises(RowIdOutOfRangeError):
        dmp(out_of_range_batch())
    # A mode the user chose is respected: through FBGEMM's environment variable ...
    os.environ["FBGEMM_TBE_BOUNDS_CHECK_MODE"] = str(fatal)
    try:
        dmp = build()
    finally:
        del os.environ["FBGEMM_TBE_BOUNDS_CHECK_MODE"]
    assert not dmp.dirty_tracker.fused_bounds_check and modes_seen_in_training(dmp) == {fatal}
    # ... or the sharder's fused_params.
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05,
             "bounds_check_mode": BoundsCheckMode.FATAL}
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused), sharders_for()[1]]
    dmp = build(sharders)
    assert not dmp.dirty_tracker.fused_bounds_check and modes_seen_in_training(dmp) == {fatal}


@pytest.mark.timeout(200)
def test_bounds_check_takeover_respects_the_users_mode_and_can_be_switched_off():
    run_ranks(_takeover_options_worker, world_size=2, timeout=150)
