"""CPR's MFU/SSU budget-limited saves, against pure-torch references computed from the batches.

* ``select_rows`` against a plain sort by (-count, id);
* MFU counters against a bincount of the looked-up ids; SSU counters against the same
  bound (every counted id was looked up, never more often) and a binomial bound on the
  sampled share, with the dirty bitmap still exact;
* ``reset(keep=...)`` keeps exactly the rows (and counts) it is given;
* Checkpointer saves with ``budget.max_rows_fraction``: per-shard budgets, the top-counted
  rows of a reference simulation of the counters, left-out rows written later, and a
  restore of the consecutive chain equal to the live model.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _toy import build_dmp, local_state

ROWS, DIM = 240, 8


# ------------------------------------------------------------------ select_rows, row_budget


def _reference_select(ids: list[int], counts: list[int], budget: int) -> list[int]:
    order = sorted(zip(counts, ids), key=lambda ci: (-ci[0], ci[1]))
    return sorted(i for _, i in order[:budget])


@pytest.mark.timeout(30)
def test_select_rows_matches_sorted_reference():
    from cnr_torchrec.ckpt.save.priority import select_rows

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(80):
        n = int(torch.randint(0, 60, (1,), generator=gen))
        ids = torch.randperm(500, generator=gen)[:n]  # unique, unsorted
        # Few distinct counts, so ties are everywhere.
        counts = torch.randint(0, 4 if trial % 2 else 1000, (n,), generator=gen, dtype=torch.int32)
        for budget in (0, 1, n // 3, max(n - 1, 0), n, n + 5):
            got = select_rows(ids, counts, budget)
            want = _reference_select(ids.tolist(), counts.tolist(), budget)
            assert got.tolist() == want, (ids, counts, budget)
            assert got.dtype == torch.int64
            checked += len(want)
    assert checked > 400


@pytest.mark.timeout(30)
def test_select_rows_ties_prefer_lower_ids_and_bad_inputs_are_named():
    from cnr_torchrec import ConfigError
    from cnr_torchrec.ckpt.save.priority import select_rows

    ids = torch.tensor([9, 2, 7, 4, 5])
    counts = torch.tensor([3, 1, 3, 3, 1], dtype=torch.int32)
    assert select_rows(ids, counts, 2).tolist() == [4, 7]  # three rows count 3: the two lowest ids
    assert select_rows(ids, counts, 4).tolist() == [2, 4, 7, 9]
    assert select_rows(ids, counts, 50).tolist() == [2, 4, 5, 7, 9]
    with pytest.raises(ConfigError, match="one count per dirty row"):
        select_rows(ids, counts[:3], 2)
    with pytest.raises(ConfigError, match=">= 0"):
        select_rows(ids, counts, -1)


@pytest.mark.timeout(30)
def test_row_budget_is_the_ceiling_of_the_written_fraction():
    from cnr_torchrec import ConfigError
    from cnr_torchrec.ckpt.save.priority import row_budget

    for f in (0.001, 0.1, 0.25, 0.3, 0.33, 0.5, 0.7, 0.999, 1.0):
        for n in (1, 3, 7, 10, 100, 240, 1001):
            assert row_budget(f, n) == min(n, math.ceil(Fraction(str(f)) * n)), (f, n)
    with pytest.raises(ConfigError, match="max_rows_fraction"):
        row_budget(0.0, 10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rate", [0.002, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sync_free", [False, True])
def test_sample_lookups_keeps_each_id_in_its_bag_in_order(rate, dtype, sync_free):
    from cnr_torchrec.track._sampling import sample_lookup

    gen = torch.Generator().manual_seed(3)
    bag_sizes = torch.randint(0, 9, (300,), generator=gen)
    bag_sizes[:5] = 0  # empty bags, including the first ones
    offsets = torch.zeros(301, dtype=dtype)
    offsets[1:] = torch.cumsum(bag_sizes, 0)
    n = int(offsets[-1])
    indices = torch.randperm(n + 7, generator=gen)[: n + 7].to(dtype)  # unique ids, and 7 past the last offset
    position = {int(v): i for i, v in enumerate(indices.tolist())}
    kept_total = looked_up = 0
    for trial in range(40):
        sampler = torch.Generator().manual_seed(trial)
        kept, kept_offsets = sample_lookup(indices, offsets, rate, sampler, sync_free=sync_free)
        assert kept.dtype == dtype
        assert int(kept_offsets[0]) == 0 and bool((kept_offsets[1:] >= kept_offsets[:-1]).all())
        for b in range(300):
            bag = kept[int(kept_offsets[b]) : int(kept_offsets[b + 1])].tolist()
            # Sync-free, the ids left out are -1 (skipped by mark_rows) and the offsets unchanged.
            got = [position[v] for v in bag if not (sync_free and v == -1)]
            # Each kept id comes from its own bag, in the bag's order, at most once.
            assert got == sorted(set(got)), b
            assert all(int(offsets[b]) <= p < int(offsets[b + 1]) for p in got), b
            kept_total += len(got)
        looked_up += n
    sd = math.sqrt(looked_up * rate * (1 - rate))
    assert abs(kept_total - looked_up * rate) <= 6 * sd + 1, (kept_total, looked_up * rate)
    empty, empty_offsets = sample_lookup(indices[:0], torch.zeros(4, dtype=dtype), rate, gen, sync_free=sync_free)
    assert empty.numel() == 0 and empty_offsets.tolist() == [0, 0, 0, 0]


# ------------------------------------------------------------------ single-process tracker tests


SHARDINGS = ("row_wise", "column_wise", "table_wise", "table_row_wise", "data_parallel")


def _specs(rows=ROWS):
    from examples.toy import TableSpec

    specs = [TableSpec(f"t_{st}", rows, DIM, st, "ebc") for st in SHARDINGS]
    return specs + [TableSpec("e_row_wise", rows, DIM, "row_wise", "ec")]


def _build(specs, seed=0, **tracker_kwargs):
    return build_dmp(specs, seed=seed, dense_optimizer=torch.optim.Adagrad, **tracker_kwargs)


def _batches(specs, n, seed, batch_size=16, pooling=4):
    from examples.toy import zipf_batch

    gen = torch.Generator().manual_seed(seed)
    return [zipf_batch(specs, batch_size=batch_size, pooling=pooling, generator=gen, alpha=1.1) for _ in range(n)]


def _lookups(batch, specs, rows=ROWS):
    """Per table: how often each row was looked up in ``batch`` (every rank's ids, gathered)."""
    jts = batch.to_dict()
    out = {}
    for s in specs:
        ids = jts[s.feature].values()
        if dist.get_world_size() > 1:
            parts = [torch.zeros_like(ids) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, ids)
            ids = torch.cat(parts)
        out[s.name] = torch.bincount(ids, minlength=rows)
    return out


def _step(dmp, opt, batch):
    dmp(batch).backward()
    opt.step()
    opt.zero_grad()


def _sharded(tracker):
    return [t for t in tracker.tables() if not tracker.is_data_parallel(t)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["mfu", "ssu"])
def test_mfu_counters_equal_lookup_counts(group, mode):
    from cnr_torchrec import TrackingNotEnabledError

    specs = _specs()
    dmp, opt = _build(specs)
    tracker = dmp.dirty_tracker
    assert tracker.counting is None
    with pytest.raises(TrackingNotEnabledError, match="enable_counting"):
        tracker.update_counts("t_row_wise")
    tracker.enable_counting(mode, rate=1.0)  # SSU sampling every id counts exactly what MFU counts
    assert tracker.counting == mode
    assert tracker.bits_per_row == pytest.approx(1 + 32, rel=0.05)
    ref = {s.name: torch.zeros(ROWS, dtype=torch.int64) for s in specs}
    for batch in _batches(specs, 4, seed=1):
        for t, c in _lookups(batch, specs).items():
            ref[t] += c
        _step(dmp, opt, batch)
    shards_seen = 0
    for t in _sharded(tracker):
        rows, counts = tracker.update_counts(t)
        assert torch.equal(counts.long(), ref[t][rows]), t
        assert torch.equal(tracker.dirty_rows(t), torch.nonzero(ref[t]).flatten()), t
        shards_seen += len(tracker.shard_update_counts(t))
    assert shards_seen == 6  # column_wise has two column shards on one rank
    # Eval and no-grad forwards count nothing.
    with torch.no_grad():
        dmp(_batches(specs, 1, seed=2)[0])
    assert torch.equal(tracker.update_counts("t_row_wise")[1].long(), ref["t_row_wise"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rate", [0.05, 0.3])
def test_ssu_counts_a_sample_and_keeps_the_bitmap_exact(group, rate):
    from cnr_torchrec import ConfigError

    specs = _specs()
    dmp, opt = _build(specs)
    tracker = dmp.dirty_tracker
    with pytest.raises(ConfigError, match="not one of"):
        tracker.enable_counting("lfu")
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        tracker.enable_counting("ssu", rate=0.0)
    tracker.enable_counting("ssu", rate=rate, seed=11)
    assert tracker.counting == "ssu"
    batches = _batches(specs, 6, seed=3, batch_size=32)
    ref = {s.name: torch.zeros(ROWS, dtype=torch.int64) for s in specs}
    rng_before = torch.get_rng_state()
    for batch in batches:
        for t, c in _lookups(batch, specs).items():
            ref[t] += c
        _step(dmp, opt, batch)
    # The sampler has a generator of its own: training's RNG stream is untouched.
    assert torch.equal(torch.get_rng_state(), rng_before)

    sampled = looked_up = 0
    first = {}
    for t in _sharded(tracker):
        assert torch.equal(tracker.dirty_rows(t), torch.nonzero(ref[t]).flatten()), t  # exact, not sampled
        for _, s, counts in tracker.shard_update_counts(t):
            want = ref[t][s.rows[0] : s.rows[1]]
            c = counts.long()
            assert bool((c <= want).all()), t  # never counts more than was looked up
            assert bool(((c > 0) <= (want > 0)).all()), t  # only rows that were looked up
            sampled += int(c.sum())
            looked_up += int(want.sum())
        first[t] = tracker.update_counts(t)[1].clone()
    # Each looked-up id is kept with probability `rate`, independently: a binomial count.
    sd = math.sqrt(looked_up * rate * (1 - rate))
    assert abs(sampled - looked_up * rate) <= 6 * sd, (sampled, looked_up)
    assert 0 < sampled < looked_up

    # The same seed replays the same sample; another seed draws another one.
    for seed, same in ((11, True), (12, False)):
        tracker.reset()
        tracker.enable_counting("ssu", rate=rate, seed=seed)
        for batch in batches:
            _step(dmp, opt, batch)
        again = {t: tracker.update_counts(t)[1] for t in _sharded(tracker)}
        assert all(torch.equal(again[t], first[t]) for t in first) == same


@pytest.mark.timeout(120)
def test_reset_keep_leaves_exactly_the_kept_rows_dirty(group):
    specs = _specs()
    dmp, opt = _build(specs, count_updates=True, baseline_view=True)
    tracker = dmp.dirty_tracker
    ref = {s.name: torch.zeros(ROWS, dtype=torch.int64) for s in specs}
    batches = _batches(specs, 3, seed=4)
    for batch in batches[:2]:
        for t, c in _lookups(batch, specs).items():
            ref[t] += c
        _step(dmp, opt, batch)
    gen = torch.Generator().manual_seed(5)
    keep = {}
    for t in _sharded(tracker):
        dirty = tracker.dirty_rows(t)
        keep[t] = dirty[torch.rand(dirty.numel(), generator=gen) < 0.4]
    keep["t_data_parallel"] = torch.arange(5)  # data_parallel rows are always dirty: ignored
    since_baseline = {t: tracker.dirty_rows(t) for t in _sharded(tracker)}
    tracker.reset(keep=keep)
    for t in _sharded(tracker):
        assert torch.equal(tracker.dirty_rows(t), keep[t]), t
        rows, counts = tracker.update_counts(t)
        want = torch.zeros(ROWS, dtype=torch.int64)
        want[keep[t]] = ref[t][keep[t]]
        assert torch.equal(counts.long(), want[rows]), t
        # Nothing left the "since baseline" view.
        assert torch.equal(tracker.dirty_rows(t, since_baseline=True), since_baseline[t]), t
    assert sum(int(k.numel()) for t, k in keep.items() if t != "t_data_parallel") > 0
    # New lookups add to the kept counts.
    _step(dmp, opt, batches[2])
    add = _lookups(batches[2], specs)
    for t in _sharded(tracker):
        want = torch.zeros(ROWS, dtype=torch.int64)
        want[keep[t]] = ref[t][keep[t]]
        want += add[t]
        rows, counts = tracker.update_counts(t)
        assert torch.equal(counts.long(), want[rows]), t
        assert torch.equal(tracker.dirty_rows(t), torch.nonzero(want).flatten()), t
    with pytest.raises(Exception, match="no embedding table named"):
        tracker.reset(keep={"nope": torch.arange(2)})


# ------------------------------------------------------------------ Checkpointer, end to end


def _config(root, priority="mfu", fraction=0.1, policy="consecutive", **kw):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": policy, "quantization": {"method": "none"},
                        "budget": {"max_rows_fraction": fraction, "priority": priority, "ssu_rate": 0.5}, **kw})


_local_state = local_state


def _entries(root, ckpt_id, rank=None):
    """{table: [(rows, cols, encoding, ids or None)]} of one checkpoint (every rank, or one)."""
    from cnr_torchrec.ckpt.format.bytes.chunks import PayloadReader
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import load_manifest
    from cnr_torchrec.ckpt.format.row_ids import decode_ids

    storage = Storage(root)
    m = load_manifest(storage, ckpt_id)
    out = {}
    for report in m.ranks:
        if rank is not None and report.rank != rank:
            continue
        read = PayloadReader(storage, report.payload)
        for table, e in report.entries():
            ids = decode_ids(e.ids.kind, read(e.ids.blob), e.num_rows) if e.ids is not None else None
            out.setdefault(table, []).append((e.rows, e.cols, e.encoding, ids))
    storage.close()
    return m, out


class _Reference:
    """The counters and dirty set a budget-limited consecutive chain should have, from the batches alone."""

    def __init__(self, specs, fraction):
        self.fraction = Fraction(str(fraction))
        self.counts = {s.name: torch.zeros(ROWS, dtype=torch.int64) for s in specs if s.sharding != "data_parallel"}

    def add(self, lookups):
        for t in self.counts:
            self.counts[t] += lookups[t]

    def expected(self, table, rows):
        """Offsets MFU should write of the row range ``rows`` of ``table``."""
        r0, r1 = rows
        c = self.counts[table][r0:r1]
        dirty = torch.nonzero(c).flatten().tolist()
        budget = min(r1 - r0, math.ceil(self.fraction * (r1 - r0)))
        return _reference_select(dirty, c[dirty].tolist(), budget), budget

    def written(self, table, rows, offsets):
        self.counts[table][rows[0] + offsets] = 0


def _check_delta(root, info, ref, check_choice, rank=None):
    """Asserts one delta's entries against the budget and (MFU) the reference; updates the reference."""
    m, entries = _entries(root, info.id, rank)
    assert m.kind == "delta"
    written = 0
    for t in ref.counts:
        by_range = {}
        for rows, cols, encoding, ids in entries.get(t, []):
            n = rows[1] - rows[0]
            budget = min(n, math.ceil(ref.fraction * n))
            assert encoding == "rows" and ids is not None, (t, rows)
            assert ids.numel() <= budget, (t, rows, ids.numel(), budget)
            # Every column shard of a row range writes the same rows.
            if rows in by_range:
                assert torch.equal(by_range[rows], ids), (t, rows, cols)
            by_range[rows] = ids
        for rows, ids in by_range.items():
            if check_choice:
                want, _ = ref.expected(t, rows)
                assert ids.tolist() == want, (t, rows)
            else:  # SSU: whatever it picks must be dirty
                assert bool((ref.counts[t][rows[0] + ids] > 0).all()), (t, rows)
            ref.written(t, rows, ids)
            written += ids.numel()
    return written


def _train_and_save(root, specs, priority, check_choice, rank=0):
    from cnr_torchrec import Checkpointer

    dmp, opt = _build(specs)
    ckpt = Checkpointer(dmp, _config(root, priority), dense_optimizer=opt)
    assert dmp.dirty_tracker.counting == priority
    ref = _Reference(specs, 0.1)
    batches = _batches(specs, 8, seed=20 + rank)
    assert ckpt.save(0).wait().kind == "baseline"
    limited = 0
    for step, batch in enumerate(batches, start=1):
        ref.add(_lookups(batch, specs))
        _step(dmp, opt, batch)
        if step % 2 == 0:
            info = ckpt.save(step).wait()
            _check_delta(root, info, ref, check_choice)
            limited += int(sum(int((c > 0).sum()) for c in ref.counts.values()) > 0)
    assert limited > 0  # the budget did leave rows out
    # No more training: each save writes up to the budget, until nothing is left dirty.
    step = len(batches)
    for _ in range(20):
        if all(int((c > 0).sum()) == 0 for c in ref.counts.values()):
            break
        step += 1
        info = ckpt.save(step).wait()
        assert _check_delta(root, info, ref, check_choice) > 0
    assert all(int((c > 0).sum()) == 0 for c in ref.counts.values()), "a row was never written"
    assert all(dmp.dirty_tracker.dirty_counts()[t] == 0 for t in ref.counts)
    live = _local_state(dmp)
    ckpt.close()
    return live, step


def _restore_and_compare(root, specs, live, step, priority):
    from cnr_torchrec import Checkpointer

    fresh, opt = _build(specs, seed=9)
    before = _local_state(fresh)
    assert any(not torch.equal(before[k], live[k]) for k in live if k[-1] == "w")  # not vacuous
    restorer = Checkpointer(fresh, _config(root, priority), dense_optimizer=opt)
    assert restorer.list()[-1].chain[0] == 0  # one consecutive chain from the first baseline
    assert restorer.restore() == step
    got = _local_state(fresh)
    for key, want in live.items():
        assert torch.equal(got[key], want), key
    restorer.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("priority", ["mfu", "ssu"])
def test_budget_limited_chain_writes_top_rows_and_restores_exactly(group, tmp_path, priority):
    specs = _specs()
    root = str(tmp_path / "ck")
    live, step = _train_and_save(root, specs, priority, check_choice=priority == "mfu")
    _restore_and_compare(root, specs, live, step, priority)


@pytest.mark.timeout(60)
def test_budget_needs_the_consecutive_policy(group, tmp_path):
    from cnr_torchrec import Checkpointer, ConfigError

    specs = _specs()[:1]
    dmp, opt = _build(specs)
    for policy in ("one_shot", "intermittent", "full"):
        with pytest.raises(ConfigError, match="needs policy consecutive"):
            Checkpointer(dmp, _config(str(tmp_path / policy), policy=policy), dense_optimizer=opt)


# ------------------------------------------------------------------ two ranks


def _two_rank_worker(rank, world_size, root):
    from examples.toy import TableSpec

    # column_wise puts two column shards of the table on each rank.
    specs = [TableSpec("t_row_wise", ROWS, DIM, "row_wise"), TableSpec("t_column_wise", ROWS, DIM, "column_wise"),
             TableSpec("t_table_wise", ROWS, DIM, "table_wise")]
    for priority in ("mfu", "ssu"):  # one spawn for both: starting ranks costs more than the test
        where = os.path.join(root, priority)
        live, step = _train_and_save(where, specs, priority, check_choice=priority == "mfu", rank=rank)
        # _check_delta compared every rank's entries of each checkpoint: the column shards on both
        # ranks wrote the same rows (under SSU thanks to the summed counters). Now restore the chain.
        _restore_and_compare(where, specs, live, step, priority)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_two_ranks_budget_chain_mfu_and_ssu(tmp_path):
    run_ranks(_two_rank_worker, world_size=2, timeout=240, args=(str(tmp_path / "ck"),))
