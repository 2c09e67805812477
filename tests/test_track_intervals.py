"""The dirty-row bitmaps of the tracking intervals (``cnr_torchrec/track/intervals.py``).

``TbeBits`` keeps one TBE's "since reset" bitmap and, where asked, its "since baseline" one; ``DirtyIntervals``
holds one per TBE of a rank and reads them per table and shard. Here they are driven through their own methods,
with the TBEs of real sharded models (the toy model and TorchRec's ``TestSparseNN``, whose table-wise TBE holds two
tables at flat offsets 0 and 48 and whose column-wise tables are two shards on one rank), and compared with sets
of ids built with torch's own ops (``torch.unique``, ``torch.cat``), and with the ids of the input KJTs of real
training steps.

The same bitmaps are exercised through ``DirtyRowTracker`` elsewhere: against diffed weights and TorchRec's
``ModelDeltaTracker`` in ``test_tracker_multirank.py`` and ``test_torchrec_models.py``, the baseline view of
one-shot chains in ``test_checkpointer_multirank.py``, kept rows of budget-limited saves in ``test_priority.py``,
and the host reads they never make in ``test_sync_free.py``.
"""

from __future__ import annotations

import math

import _torchrec_models as M
import pytest
import torch

from cnr_torchrec import ops
from cnr_torchrec.errors import TrackingNotEnabledError
from cnr_torchrec.track.discovery import find_kernels, plan_table_shapes
from cnr_torchrec.track.intervals import DirtyIntervals, TbeBits
from cnr_torchrec.track.layout import ShardLayout


def _rows(bits: torch.Tensor) -> list[int]:
    """The set bits of a bitmap, by the pure-torch reference of ``bitmap_to_rows``."""
    return ops.reference_bitmap_to_rows(bits, 0, bits.numel() * 64).tolist()


def _ids(*parts: list[int]) -> list[int]:
    return torch.unique(torch.cat([torch.tensor(p, dtype=torch.int64) for p in parts])).tolist()


def test_tbe_bits_keep_each_interval_and_the_rows_since_the_baseline():
    gen = torch.Generator().manual_seed(0)
    n = 130  # three words, the last one partly used
    bits = TbeBits(n, torch.device("cpu"), baseline=True)
    first = torch.randint(0, n, (40,), generator=gen)
    bits.mark(first)
    assert _rows(bits.view(False)) == _ids(first.tolist())
    assert _rows(bits.view(True)) == _ids(first.tolist())

    # A new interval (not a baseline): "since reset" starts empty, "since baseline" keeps the first interval.
    bits.restart(baseline=False, kept=None)
    assert _rows(bits.view(False)) == []
    second = torch.tensor([0, 63, 64, 129, 129])
    bits.mark(second)
    assert _rows(bits.view(False)) == _ids(second.tolist())
    assert _rows(bits.view(True)) == _ids(first.tolist(), second.tolist())

    # Rows a budget-limited save left out stay dirty in the next interval, and in the baseline view.
    kept = torch.tensor([5, 100])
    bits.restart(baseline=False, kept=kept)
    assert _rows(bits.view(False)) == [5, 100]
    assert _rows(bits.view(True)) == _ids(first.tolist(), second.tolist(), [5, 100])
    third = torch.tensor([7, 128])
    bits.mark(third)
    assert _rows(bits.view(True)) == _ids(first.tolist(), second.tolist(), [5, 100], third.tolist())

    # A baseline: both views start again, with only the kept rows.
    bits.restart(baseline=True, kept=torch.tensor([2]))
    assert _rows(bits.view(False)) == [2] and _rows(bits.view(True)) == [2]
    bits.restart(baseline=True, kept=None)
    assert _rows(bits.view(False)) == [] and _rows(bits.view(True)) == []
    assert bits.bits() == 2 * math.ceil(n / 64) * 64


def test_tbe_bits_without_a_baseline_refuse_the_baseline_view_by_name():
    bits = TbeBits(70, torch.device("cpu"), baseline=False)
    bits.mark(torch.tensor([3, 69]))
    assert _rows(bits.view(False)) == [3, 69]
    with pytest.raises(TrackingNotEnabledError, match="baseline_view=True"):
        bits.view(True)
    assert bits.bits() == math.ceil(70 / 64) * 64
    bits.restart(baseline=False, kept=None)  # no baseline bitmap to fold into: the interval alone restarts
    assert _rows(bits.view(False)) == []


def _sparse_nn_layout() -> ShardLayout:
    """TorchRec's TestSparseNN under plan "B" on this process's one rank, plain TorchRec sharding (no tracker)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    torch.manual_seed(0)
    module = M.make_model("sparse_nn")
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=M.build_plan(module, "sparse_nn", "B", 1),
                                   sharders=M.sharders())
    return ShardLayout(plan_table_shapes(dmp), find_kernels(dmp))


def _flat(layout: ShardLayout, table: str, shard: int, rows: list[int]) -> dict[int, torch.Tensor]:
    """Global ``rows`` of ``table`` as flat rows of the TBE that holds its shard number ``shard``."""
    i, s = layout.shards(table)[shard]
    return {i: torch.tensor(rows, dtype=torch.int64) - s.rows[0] + s.flat_start}


def test_dirty_intervals_read_each_tables_rows_out_of_its_shards(group):
    layout = _sparse_nn_layout()
    # The cases this test is about, as TorchRec lays out plan "B" on one rank.
    (i_repl, repl), = layout.shards("repl")
    (i_trio, trio), = layout.shards("trio")
    assert i_repl == i_trio and trio.flat_start != trio.rows[0]  # two tables on one TBE
    assert len(layout.shards("abc")) == 2  # two column shards of one table
    assert layout.kernels[layout.shards("solo")[0][0]].data_parallel

    intervals = DirtyIntervals(layout, baseline_view=True)
    marked = {"repl": [0, 47, 3], "trio": [0, 39, 39, 12], "user_item": [5, 6, 47]}
    for table, rows in marked.items():
        intervals.mark(_flat(layout, table, 0, rows))
    abc_left, abc_right = [1, 2, 55], [2, 30]
    intervals.mark(_flat(layout, "abc", 0, abc_left))
    intervals.mark(_flat(layout, "abc", 1, abc_right))

    for table, rows in marked.items():
        assert intervals.dirty_rows(table, False).tolist() == _ids(rows), table
        assert intervals.dirty_count(table, False) == len(_ids(rows)), table
        (_, s, offsets), = intervals.shard_dirty_rows(table, False)
        assert offsets.tolist() == [r - s.rows[0] for r in _ids(rows)], table
    # Column shards of one table: each its own rows, the table their union, counted once.
    assert [o.tolist() for _, _, o in intervals.shard_dirty_rows("abc", False)] == [_ids(abc_left), _ids(abc_right)]
    assert intervals.dirty_rows("abc", False).tolist() == _ids(abc_left, abc_right)
    assert intervals.dirty_count("abc", False) == len(_ids(abc_left, abc_right))
    # Untouched tables are clean; a data_parallel table is every row (a dense optimizer may change any).
    assert intervals.dirty_rows("pair", False).tolist() == [] and intervals.dirty_count("pair", False) == 0
    assert intervals.dirty_rows("solo", False).tolist() == list(range(40))
    assert intervals.dirty_count("solo", False) == 40

    # The next interval keeps what a save left out of the first; the baseline view has the first one whole.
    intervals.restart(baseline=False, kept=_flat(layout, "trio", 0, [12]))
    intervals.mark(_flat(layout, "repl", 0, [20]))
    assert intervals.dirty_rows("trio", False).tolist() == [12]
    assert intervals.dirty_rows("repl", False).tolist() == [20]
    assert intervals.dirty_rows("repl", True).tolist() == _ids(marked["repl"], [20])
    assert intervals.dirty_count("repl", True) == len(_ids(marked["repl"], [20]))
    assert intervals.dirty_rows("abc", True).tolist() == _ids(abc_left, abc_right)
    assert intervals.dirty_rows("abc", False).tolist() == []

    # The bits held are those of the sharded TBEs' two views: the data_parallel TBE holds none.
    sharded = [k.num_rows for k in layout.kernels if not k.data_parallel]
    assert intervals.bits() == sum(2 * math.ceil(n / 64) * 64 for n in sharded)


def test_a_baseline_view_enabled_later_starts_empty_and_then_follows_the_intervals(group):
    layout = _sparse_nn_layout()
    intervals = DirtyIntervals(layout, baseline_view=False)
    assert not intervals.has_baseline_view
    with pytest.raises(TrackingNotEnabledError):
        intervals.dirty_rows("repl", True)
    intervals.mark(_flat(layout, "repl", 0, [1, 2]))
    intervals.enable_baseline_view()
    assert intervals.has_baseline_view
    assert intervals.dirty_rows("repl", True).tolist() == [1, 2]  # the open interval is in the view ...
    intervals.restart(baseline=True, kept={})
    intervals.mark(_flat(layout, "repl", 0, [9]))
    intervals.restart(baseline=False, kept={})
    intervals.mark(_flat(layout, "repl", 0, [30]))
    assert intervals.dirty_rows("repl", True).tolist() == [9, 30]  # ... and a baseline starts it again


def _toy_batch_ids(kjt, specs) -> dict[str, list[int]]:
    jts = kjt.to_dict()
    return {s.name: torch.unique(jts[s.feature].values()).tolist() for s in specs}


def test_the_tracker_intervals_hold_the_ids_each_training_step_looked_up(group):
    """Real lookups of the toy model: each interval's rows are the ids its KJTs carried."""
    from _toy import build_dmp

    from examples.toy import TableSpec, zipf_batch

    specs = [TableSpec("rw", 64, 8, "row_wise"), TableSpec("cw", 40, 8, "column_wise"),
             TableSpec("seq", 48, 8, "table_wise", "ec")]
    dmp, opt = build_dmp(specs, baseline_view=True)
    tracker = dmp.dirty_tracker
    gen = torch.Generator().manual_seed(1)
    seen: dict[str, list[int]] = {s.name: [] for s in specs}
    for step in range(3):
        kjt = zipf_batch(specs, batch_size=6, pooling=3, generator=gen, alpha=0.5)
        dmp(kjt).backward()
        opt.step()
        opt.zero_grad()
        ids = _toy_batch_ids(kjt, specs)
        for s in specs:
            seen[s.name] = _ids(seen[s.name], ids[s.name])
            assert tracker.dirty_rows(s.name).tolist() == ids[s.name], (s.name, step)
            assert tracker.dirty_rows(s.name, since_baseline=True).tolist() == seen[s.name], (s.name, step)
            assert tracker.dirty_counts(since_baseline=True)[s.name] == len(seen[s.name])
        tracker.reset(baseline=step == 1)
        if step == 1:
            seen = {s.name: [] for s in specs}
        assert all(n == 0 for n in tracker.dirty_counts().values())
