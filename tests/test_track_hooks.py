"""The forward hooks that mark each training lookup's rows (``cnr_torchrec/track/hooks.py``).

``LookupHooks`` is installed here by itself on a model sharded by plain TorchRec (``DistributedModelParallel``,
no ``CheckNRunDMP``, so no other hook is on the TBEs), with bitmaps (``DirtyIntervals``) and counters
(``LookupCounters``) of its own. The model is TorchRec's ``TestSparseNN`` under plan "B" on one rank, fed by
TorchRec's ``ModelInput``: tables shared by two and three features, two tables on one table-wise TBE, id-score
(weighted) tables, column shards and a data_parallel table. The references are the ids the input KJTs carry,
their multiplicities (``torch.bincount``), and the rows whose weights FBGEMM's own update changed.

The hooks are exercised through ``DirtyRowTracker`` elsewhere: every sharding type on 2 ranks against diffed
weights and ``ModelDeltaTracker`` (``test_tracker_multirank.py``), TorchRec's models and VBE batches
(``test_torchrec_models.py``), pipelines whose lookups are in flight across a save (``test_pipelines.py``), host
reads of sync-free tracking (``test_sync_free.py``), and the caching kernel (``test_tbe_cache.py``).
"""

from __future__ import annotations

import _torchrec_models as M
import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

from cnr_torchrec.errors import MalformedLookupError, RowIdOutOfRangeError
from cnr_torchrec.track.counters import LookupCounters
from cnr_torchrec.track.discovery import find_kernels, plan_table_shapes
from cnr_torchrec.track.hooks import LookupHooks
from cnr_torchrec.track.intervals import DirtyIntervals
from cnr_torchrec.track.layout import ShardLayout

MODEL, PLAN = "sparse_nn", "B"


class Hooked:
    """TestSparseNN sharded by TorchRec, with LookupHooks marking into bitmaps and MFU counters of its own."""

    def __init__(self, seed: int = 0) -> None:
        import torch.distributed as dist
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        torch.manual_seed(seed)
        module = M.make_model(MODEL)
        self.dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                            device=torch.device("cpu"),
                                            plan=M.build_plan(module, MODEL, PLAN, 1), sharders=M.sharders())
        self.opt = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(self.dmp.named_parameters())
                                    if p.requires_grad], lr=0.01)
        self.layout = ShardLayout(plan_table_shapes(self.dmp), find_kernels(self.dmp))
        self.configured = [k.tbe.bounds_check_mode_int for k in self.layout.kernels if not k.data_parallel]
        self.intervals = DirtyIntervals(self.layout, baseline_view=False)
        self.counters = LookupCounters(self.layout, count_updates=True)
        self.hooks = LookupHooks(self.layout, self.intervals.tbes, self.counters.tbes, fuse_bounds_check=True,
                                 sync_free=False)

    def sharded_tables(self) -> list[str]:
        return [t.name for t in M.MODELS[MODEL]
                if not self.layout.kernels[self.layout.shards(t.name)[0][0]].data_parallel]

    def weights(self) -> dict[str, list[torch.Tensor]]:
        return {t: [k.tbe.split_embedding_weights()[s.local_index].detach().clone()
                    for k, s in ((self.layout.kernels[i], s) for i, s in self.layout.shards(t))]
                for t in self.sharded_tables()}

    def new_interval(self) -> None:
        """What ``DirtyRowTracker.reset`` does with the hooks: a new interval, then the lookups in flight."""
        self.intervals.restart(baseline=False, kept={})
        self.hooks.remark_in_flight()

    def tbe_of(self, table: str):
        i, s = self.layout.shards(table)[0]
        return self.layout.kernels[i].tbe


def _table_values(batch) -> dict[str, torch.Tensor]:
    """Per table: every id its features carried in ``batch`` (repeats kept), read from TorchRec's KJTs."""
    out = {}
    for t in M.MODELS[MODEL]:
        jts = (batch.idscore_features if t.kind == "weighted" else batch.idlist_features).to_dict()
        out[t.name] = torch.cat([jts[f].values() for f in t.features])
    return out


def _step(h: Hooked, batch) -> None:
    M.train_step(h.dmp, h.opt, batch)


def test_a_training_step_marks_and_counts_exactly_the_ids_its_features_carried(group):
    h = Hooked()
    # The cases this test is about, as TorchRec lays out plan "B".
    assert h.tbe_of("repl") is h.tbe_of("trio")  # two tables, five features on one TBE
    assert len(h.layout.shards("abc")) == 2 and {"scored", "scored1"} <= set(h.sharded_tables())
    batch = M.make_batch(MODEL, seed=3)
    before = h.weights()
    _step(h, batch)
    after = h.weights()
    values = _table_values(batch)
    for table in h.sharded_tables():
        ids = torch.unique(values[table])
        assert ids.numel() > 0, table
        assert torch.equal(h.intervals.dirty_rows(table, False), ids), table
        for (_, s, counts), w0, w1 in zip(h.counters.shard_update_counts(table), before[table], after[table]):
            # Every lookup of the row counted, over all features of the table (a shared table's ids add up) ...
            want = torch.bincount(values[table], minlength=s.rows[1])[s.rows[0]:s.rows[1]]
            assert torch.equal(counts.long(), want), (table, s.cols)
            # ... and the rows marked are the rows FBGEMM's fused update changed.
            changed = torch.nonzero((w0 != w1).any(dim=1)).flatten() + s.rows[0]
            assert torch.equal(changed, ids), (table, s.cols)
    assert h.intervals.dirty_rows("solo", False).numel() == 40  # data_parallel: every row, never hooked


def test_lookups_outside_training_mark_nothing_and_keep_fbgemms_bounds_check(group):
    h = Hooked()
    batch = M.make_batch(MODEL, seed=4)
    seen = []
    probes = [k.tbe.register_forward_pre_hook(lambda m, a, kw: seen.append(m.bounds_check_mode_int),
                                              with_kwargs=True)
              for k in h.layout.kernels if not k.data_parallel]
    h.dmp.eval()
    h.dmp(batch)
    h.dmp.train()
    with torch.no_grad():
        h.dmp(batch)
    assert all(h.intervals.dirty_count(t, False) == 0 for t in h.sharded_tables())
    assert all(int(c.sum()) == 0 for t in h.sharded_tables() for _, _, c in h.counters.shard_update_counts(t))
    assert seen and set(seen) == set(h.configured), seen  # FBGEMM checked these lookups' bounds itself
    seen.clear()
    _step(h, batch)  # a training lookup: the marking pass checked every id, so FBGEMM skips its own pass
    assert seen and set(seen) == {BoundsCheckMode.NONE.value}, seen
    assert all(h.intervals.dirty_count(t, False) > 0 for t in h.sharded_tables())
    for p in probes:
        p.remove()


def test_a_lookup_whose_update_is_still_to_come_is_marked_in_the_next_interval(group):
    h = Hooked()
    batch = M.make_batch(MODEL, seed=5)
    values = _table_values(batch)
    loss, _ = h.dmp(batch)
    h.new_interval()  # a save between the lookup and its update
    for table in h.sharded_tables():
        assert torch.equal(h.intervals.dirty_rows(table, False), torch.unique(values[table])), table
    loss.backward()  # the update runs (fused): the lookup is no longer in flight
    h.opt.step()
    h.opt.zero_grad()
    h.new_interval()
    assert all(h.intervals.dirty_count(t, False) == 0 for t in h.sharded_tables())


def _one_bag_per_feature(tbe, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    assert len(ids) == len(tbe.feature_table_map)
    return torch.tensor(ids, dtype=torch.int64), torch.arange(len(ids) + 1, dtype=torch.int64)


def test_a_bad_id_is_refused_before_the_lookup_naming_the_table_its_feature_reads(group):
    h = Hooked()
    tbe = h.tbe_of("trio")
    # Features 0-1 read 'repl' (48 rows), 2-4 read 'trio' (40 rows): 45 is a row of the first, not the second.
    assert list(tbe.feature_table_map) == [0, 0, 1, 1, 1]
    ran = []
    probe = tbe.register_forward_hook(lambda *a: ran.append(True))
    with pytest.raises(RowIdOutOfRangeError, match=r"table 'trio' was looked up with id 45, outside the 40 rows"):
        tbe(*_one_bag_per_feature(tbe, [45, 1, 2, 45, 3]))
    assert not ran  # refused before FBGEMM ran the lookup
    h.new_interval()  # (the refused lookup's in-range ids were marked: more rows saved, never fewer)
    tbe(*_one_bag_per_feature(tbe, [45, 47, 2, 39, 3]))  # in range for each feature's table: marked
    probe.remove()
    assert h.intervals.dirty_rows("repl", False).tolist() == [45, 47]
    assert h.intervals.dirty_rows("trio", False).tolist() == [2, 3, 39]


def test_per_sample_weights_that_do_not_match_the_ids_are_refused_by_name(group):
    h = Hooked()
    tbe = h.tbe_of("scored")  # an id-score table: its lookups carry one weight per id
    indices, offsets = _one_bag_per_feature(tbe, [1, 2])
    tbe(indices, offsets, per_sample_weights=torch.ones(2))
    assert h.intervals.dirty_rows("scored", False).tolist() == [1, 2]
    with pytest.raises(MalformedLookupError, match="3 per-sample weights for 2 ids"):
        tbe(indices, offsets, per_sample_weights=torch.ones(3))
    with pytest.raises(MalformedLookupError, match="bad bag layout"):
        tbe(indices, torch.tensor([0, 2, 1]), per_sample_weights=torch.ones(2))  # offsets decrease


def test_removed_hooks_mark_nothing_and_give_back_the_configured_bounds_check(group):
    h = Hooked()
    _step(h, M.make_batch(MODEL, seed=6))
    sharded = [k.tbe for k in h.layout.kernels if not k.data_parallel]
    # The last lookup was one the hooks checked: FBGEMM's own pass is off.
    assert {t.bounds_check_mode_int for t in sharded} == {BoundsCheckMode.NONE.value}
    h.hooks.remove()
    assert [t.bounds_check_mode_int for t in sharded] == h.configured
    h.new_interval()
    _step(h, M.make_batch(MODEL, seed=7))
    assert all(h.intervals.dirty_count(t, False) == 0 for t in h.sharded_tables())
