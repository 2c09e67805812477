"""Managed-collision (sort-zch) tables moved onto another world size, against what TorchRec itself routes, reserves
and holds. Each check guards a one-line bug that a mutation audit planted and every other test let through:

* the slot TorchRec reserves for the ids a module misses (the row ``remap`` gives an id it does not hold) holds no
  relocated id, every id that fits is kept and found by TorchRec's own lookup, and a missed id after the restore
  trains that reserved row alone, as it does in TorchRec's own DCP load of the same state (2 -> 1);
* each rank's eviction-window history after the move is the saved ranks' entries that TorchRec's input
  distribution sends to it, and the next eviction equals the one of a TorchRec model given that history;
* raw ids at block edges of an input hash size no world size here divides (4001), and ids past the last block, go
  to the rank TorchRec's input distribution sends them to, also with ``buckets()`` above the world size.

The saved tables are full (every slot but the reserved one held). On 3 ranks (from 2) and on 2 (from 1) some rank
receives more held ids than it has slots; on 1 rank (from 2) every held id fits. The model is ``_mc_models.py``'s
MC-EBC; a few ids at block edges and past the last block are looked up at every step, so that they are held.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

EMPTY = torch.iinfo(torch.int64).max
INPUT = 4001  # prime: floor(INPUT / W) and TorchRec's ceil(INPUT / W) give other blocks on 2, 3 and 4 ranks
EDGE_IDS = (1333, 2000, 2666, 2667)  # ids whose rank a floor block changes on 2 or 3 ranks
PAST_IDS = (4002, 4003, 9001)  # past the last block on 2 and 3 ranks: TorchRec routes them by remainder
INTERVAL = 3
STEPS = 11  # evictions at steps 2, 5 and 8; the checkpoint's eviction window holds steps 9 and 10
FEATURE = {"big": "f_a", "small": "f_c"}  # the feature that looks each table up


def _config(root):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "restore_rng": True,
                        "quantization": {"method": "none", "residual": False}})


def _model(world_size, *, policy, optimizer, seed=0, buckets=None, ours=True, input_size=INPUT):
    """The fixture model on ``world_size`` ranks (``CheckNRunDMP``, or TorchRec's own DMP with ``ours=False``).
    ``buckets`` sets the sharded modules' ``buckets()`` per table before the input distribution is built: TorchRec's
    sharder gives every module one bucket per rank, and this is the one way to another count in torchrec 1.8."""
    import _mc_models as M

    from cnr_torchrec import CheckNRunDMP

    kw = {"dmp_cls": CheckNRunDMP} if ours else {}
    model = M.build_mc_model("ebc", world_size, policy=policy, optimizer=optimizer, eviction_interval=INTERVAL,
                             input_hash_size=input_size, seed=seed, **kw)
    for table, count in (buckets or {}).items():
        model.mc_modules()[table]._buckets = count
    return model


def _batches(n, world_size, rank, global_batch=8):
    """The fixture's skewed batches, with ``EDGE_IDS`` and ``PAST_IDS`` in the first sample of rank 0 for each
    table: looked up at every step, they are held at the save."""
    import _mc_models as M
    from torchrec import KeyedJaggedTensor

    out = []
    for kjt in M.mc_batches(n, world_size, rank, seed=1, input_hash_size=INPUT, global_batch=global_batch):
        values, lengths = [], []
        for key, jt in kjt.to_dict().items():
            v, l = jt.values(), jt.lengths().clone()
            if rank == 0 and key in FEATURE.values():
                v = torch.cat([torch.tensor(EDGE_IDS + PAST_IDS), v])
                l[0] += len(EDGE_IDS + PAST_IDS)
            values.append(v)
            lengths.append(l)
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=torch.cat(values),
                                                       lengths=torch.cat(lengths)))
    return out


def _gather(obj):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def _weights(model, table):
    """This rank's rows of ``table`` as TorchRec's state_dict holds them: (first global row, weights)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    (value,) = [v for k, v in model.dmp.state_dict().items()
                if k.endswith(f".{table}.weight") and isinstance(v, ShardedTensor)]
    (shard,) = value.local_shards()
    return shard.metadata.shard_offsets[0], shard.tensor.detach().clone()


def _held(model):
    """Every rank's held raw ids from TorchRec's own buffers: ``{(table, raw id): (weights, metadata, rank)}``."""
    mine = {}
    for table, mch in model.mc_modules().items():
        start, weights = _weights(model, table)
        raw, rows = mch._mch_sorted_raw_ids, mch._mch_remapped_ids_mapping
        for p in torch.nonzero(raw != EMPTY).view(-1).tolist():
            meta = torch.stack([m[p] for m in mch._mch_metadata.values()])
            mine[(table, int(raw[p]))] = (weights[int(rows[p]) - start], meta, dist.get_rank())
    return {k: v for part in _gather(mine) for k, v in part.items()}


def _window(mch):
    """The eviction window a TorchRec module holds: its history entries as sorted ``(id, metadata...)``."""
    n = mch._current_history_buffer_offset
    cols = [mch._history_accumulator[:n], *(v[:n] for _, v in sorted(mch._history_metadata.items()))]
    return sorted(zip(*(c.tolist() for c in cols)))


def _reserved_row(mch, table, held):
    """The global row TorchRec's module gives an id it does not hold (asked of the module, not assumed)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    probe = EMPTY - 1
    assert (table, probe) not in held
    out = mch.remap({table: JaggedTensor(values=torch.tensor([probe]), lengths=torch.tensor([1]))})
    return int(out[table].values()[0])


def _torchrec_ranks(model, ids):
    """The rank TorchRec's input distribution sends each of ``ids[table]`` to: rank 0 feeds them all through the
    sharded module's own ``input_dist``, and each rank reports what it received. ``{table: {id: rank}}``."""
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionContext

    rank = dist.get_rank()
    feed = {FEATURE[t]: (v if rank == 0 else []) for t, v in ids.items()}
    keys = model.features
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor([i for k in keys for i in feed.get(k, [])], dtype=torch.int64),
        lengths=torch.tensor([len(feed.get(k, [])) for k in keys], dtype=torch.int64))
    ctx = ManagedCollisionCollectionContext(sharding_contexts=[])
    (got,) = model.sharded_mc._managed_collision_collection.input_dist(ctx, kjt).wait().wait()
    received = {t: got.to_dict()[f].values().tolist() for t, f in FEATURE.items()}
    out = {t: {} for t in ids}
    for r, part in enumerate(_gather(received)):
        for t, got_ids in part.items():
            for i in got_ids:
                assert out[t].setdefault(i, r) == r, (t, i)
    assert all(set(out[t]) == set(ids[t]) for t in ids), "TorchRec's input distribution lost ids"
    return out


def _edge_ids(buckets):
    """Ids at the edges of ceil and floor blocks of ``INPUT`` over ``buckets``, and past the last block."""
    ceil, floor = -(-INPUT // buckets), INPUT // buckets
    ids = {INPUT - 1, INPUT, INPUT + 1, 3 * INPUT + 7, 2**40 + 3, *EDGE_IDS, *PAST_IDS}
    for k in range(1, buckets + 1):
        ids |= {k * ceil - 1, k * ceil, k * ceil + 1, k * floor - 1, k * floor, k * floor + 1}
    return sorted(ids)


# ----------------------------------------------------------------------------- the saving job


def _save_job(rank, world_size, root, record, policy, optimizer, dcp_path):
    """Trains ``STEPS`` steps saving at 3, 7 and ``STEPS``; records what TorchRec holds at the last save (held ids,
    each rank's eviction window and counters) and, with ``dcp_path``, TorchRec's own DCP checkpoint of it."""
    import _mc_models as M
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec import Checkpointer

    model = _model(world_size, policy=policy, optimizer=optimizer)
    torch.manual_seed(100 + rank)
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(_batches(STEPS, world_size, rank)):
            if step in (3, 7):
                ck.save(step).wait()
            M.train_step(model, batch)
        ck.save(STEPS).wait()
    if dcp_path:
        dcp.save(model.dmp.state_dict(), checkpoint_id=dcp_path)
    held = _held(model)
    windows = _gather({t: {"window": _window(m), "counters": _counters(m)} for t, m in model.mc_modules().items()})
    free = {t: m._zch_size - 1 - int((m._mch_sorted_raw_ids != EMPTY).sum()) for t, m in model.mc_modules().items()}
    assert not any(free.values()), f"rank {rank}: the fixture's tables are not full at the save: {free} slots free"
    assert all((t, i) in held for t in FEATURE for i in EDGE_IDS + PAST_IDS), "the edge ids are not held"
    if rank == 0:
        torch.save({"held": held, "windows": windows}, record)


def _counters(mch):
    return (mch._current_iter, mch._last_eviction_iter, int(mch._current_iter_tensor.item()))


# ----------------------------------------------------------------------------- the checks after a move


def _check_routing(model, ids):
    """Our ``route`` against TorchRec's input distribution for ``ids`` (per table); returns TorchRec's ranks."""
    from cnr_torchrec.track.managed_collision import route

    world_size = dist.get_world_size()
    want = _torchrec_ranks(model, ids)
    by_position = any(m.buckets() % world_size for m in model.mc_modules().values())
    for table, mch in model.mc_modules().items():
        raw = torch.tensor(sorted(want[table]), dtype=torch.int64)
        got = route(raw, mch.input_size(), world_size, mch.buckets(), by_position=by_position)
        wrong = [(int(i), int(g), want[table][int(i)]) for i, g in zip(raw, got) if int(g) != want[table][int(i)]]
        assert not wrong, f"{table}: (raw id, route, TorchRec's rank) {wrong[:8]}"
    return want


def _check_slots(model, saved, ranks, over):
    """After the move: TorchRec's reserved row holds no id, each rank keeps min(ids TorchRec sends it, its other
    slots) of the saved held ids (the most frequent, under LFU), each with its saved weights and metadata, as
    TorchRec's own lookup finds it. ``over``: whether some rank must have received more ids than it has slots."""
    from test_managed_collision import _looked_up

    rank, world_size = dist.get_rank(), dist.get_world_size()
    held = _held(model)
    for table, mch in model.mc_modules().items():
        reserved = _reserved_row(mch, table, held)
        rows = mch._mch_remapped_ids_mapping[mch._mch_sorted_raw_ids != EMPTY]
        taken = mch._mch_sorted_raw_ids[mch._mch_remapped_ids_mapping == reserved]
        assert reserved not in rows.tolist(), (
            f"rank {rank}, {table}: row {reserved}, where TorchRec sends every id it misses, holds raw id "
            f"{taken.tolist()}")
    slots = {t: mch._zch_size - 1 for t, mch in model.mc_modules().items()}  # all but the reserved one
    overfull = False
    for table in FEATURE:
        routed = [[i for (t, i) in saved if t == table and ranks[table][i] == r] for r in range(world_size)]
        kept = [[i for (t, i), v in held.items() if t == table and v[2] == r] for r in range(world_size)]
        slots_of = _gather(slots[table])
        for r in range(world_size):
            assert set(kept[r]) <= set(routed[r]), (
                f"{table}: raw ids {sorted(set(kept[r]) - set(routed[r]))} are held on rank {r}, and TorchRec sends "
                "them to another rank")
            assert len(kept[r]) == min(len(routed[r]), slots_of[r]), (
                f"{table} on rank {r}: {len(kept[r])} ids kept of {len(routed[r])} TorchRec sends it, with "
                f"{slots_of[r]} slots besides the reserved one")
            overfull |= len(routed[r]) > slots_of[r]
            dropped = set(routed[r]) - set(kept[r])
            if dropped and model.policy == "lfu":
                count = lambda i: int(saved[(table, i)][1][0])  # noqa: E731
                assert max(map(count, dropped)) <= min(map(count, kept[r])), (table, r)
    assert over is None or overfull == over, f"the fixture no longer {'over' if over else 'under'}fills a rank"
    for key, (w, meta, _) in held.items():
        assert torch.equal(w, saved[key][0]) and torch.equal(meta, saved[key][1]), key
    for key, row in _looked_up(model, held).items():
        assert torch.equal(row, saved[key][0]), f"TorchRec's lookup of {key} does not find its saved row"
    return held


def _check_misses(model, held, theirs=None):
    """Ids no rank holds, looked up and trained (eval mode: no profiling, no eviction), change TorchRec's reserved
    row of each rank and nothing else; with ``theirs`` (TorchRec's own load of the same state), the same row and
    the same values, before and after."""
    from torchrec import KeyedJaggedTensor

    rank, world_size = dist.get_rank(), dist.get_world_size()
    missing = [i for i in range(5, INPUT, 37) if all((t, i) not in held for t in FEATURE)]
    mine = missing[rank::world_size]  # over the whole id range: every rank receives some
    batch = KeyedJaggedTensor.from_lengths_sync(
        keys=model.features, values=torch.tensor(mine * len(model.features)),
        lengths=torch.tensor([len(mine) // 2, len(mine) - len(mine) // 2] * len(model.features)))
    reserved_rows = []  # per model: {table: (row, before, after)}
    for m in (model, theirs) if theirs is not None else (model,):
        before = {t: _weights(m, t) for t in FEATURE}
        reserved = {t: _reserved_row(mch, t, held) for t, mch in m.mc_modules().items()}
        m.dmp.eval()
        m.dmp(batch).backward()
        m.dmp.train()
        m.dense_optimizer.zero_grad()
        for table, (start, w0) in before.items():
            _, w1 = _weights(m, table)
            changed = (torch.nonzero((w0 != w1).any(dim=1)).view(-1) + start).tolist()
            assert changed == [reserved[table]], (
                f"rank {rank}, {table}: missed ids trained rows {changed}, TorchRec reserves row {reserved[table]}")
        reserved_rows.append({t: (row, before[t][1][row - before[t][0]], _weights(m, t)[1][row - before[t][0]])
                              for t, row in reserved.items()})
    if theirs is not None:
        for table in FEATURE:
            (r1, a0, a1), (r2, b0, b1) = reserved_rows[0][table], reserved_rows[1][table]
            assert r1 == r2 and torch.equal(a0, b0) and torch.equal(a1, b1), (
                f"{table}: the reserved row differs from TorchRec's own load of the same state")


def _check_window(model, windows, ranks):
    """Each rank's history after the move is the saved ranks' entries TorchRec sends it; the counters are saved."""
    rank = dist.get_rank()
    for table, mch in model.mc_modules().items():
        want = sorted(e for w in windows for e in w[table]["window"] if ranks[table][e[0]] == rank)
        assert _window(mch) == want, (
            f"rank {rank}, {table}: the restored eviction window is not the saved entries TorchRec routes here "
            f"({len(_window(mch))} entries against {len(want)})")
        assert _counters(mch) == windows[0][table]["counters"]


def _check_next_eviction(model, windows, ranks):
    """The next step (an eviction) from the restored model equals the same step from TorchRec's own model given
    the same state through ``load_state_dict`` and the history TorchRec routes to each rank in its own buffers."""
    import _mc_models as M

    rank, world_size = dist.get_rank(), dist.get_world_size()
    ref = _model(world_size, policy=model.policy, optimizer=model.optimizer, seed=9, ours=False)
    ref.dmp.load_state_dict(model.dmp.state_dict())
    if model.optimizer != "sgd":
        ref.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())
    for table, mch in ref.mc_modules().items():
        entries = [e for w in windows for e in w[table]["window"] if ranks[table][e[0]] == rank]
        size = model.mc_modules()[table]._input_history_buffer_size  # the buffer's length is not compared
        mch._input_history_buffer_size = size
        mch._history_accumulator = torch.zeros(size, dtype=torch.int64)
        for name, _, is_history in mch._eviction_policy.metadata_info:  # as the module allocates them
            if is_history:
                mch.register_buffer(f"_history_{name}", torch.zeros(size, dtype=torch.int64), persistent=False)
                mch._history_metadata[name] = getattr(mch, f"_history_{name}")
        names = sorted(mch._history_metadata)
        for k, e in enumerate(entries):
            mch._history_accumulator[k] = e[0]
            for j, name in enumerate(names, start=1):
                mch._history_metadata[name][k] = e[j]
        mch._current_history_buffer_offset = len(entries)
        mch._current_iter, mch._last_eviction_iter, it = windows[0][table]["counters"]
        mch._current_iter_tensor.fill_(it)
    (batch,) = _batches(STEPS + 1, world_size, rank, global_batch=12)[STEPS:]  # 12: split evenly over 1, 2, 3
    before = {t: m._last_eviction_iter for t, m in model.mc_modules().items()}
    for m in (model, ref):
        torch.manual_seed(500 + rank)  # evictions draw the new rows from the global RNG
        M.train_step(m, batch)
    for table, mch in model.mc_modules().items():
        other = ref.mc_modules()[table]
        assert mch._last_eviction_iter > before[table], "the step after the restore did not evict"
        bufs = ["_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", *(f"_mch_{k}" for k in mch._mch_metadata)]
        bad = [b for b in bufs if not torch.equal(getattr(mch, b), getattr(other, b))]
        assert not bad and torch.equal(_weights(model, table)[1], _weights(ref, table)[1]), (
            f"rank {rank}, {table}: the eviction after the move differs from TorchRec's with the routed history "
            f"({bad or 'weights'})")


def _move_job(rank, world_size, root, record, policy, optimizer, over, dcp_path=None, buckets=None):
    """Restores ``root`` onto ``world_size`` ranks and checks routing, slots, misses, the window and the next
    eviction; with ``dcp_path``, against TorchRec's own load of its DCP checkpoint; with ``buckets``, then again
    (routing and slots) on a model whose modules have those ``buckets()``."""
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec import Checkpointer

    saved = torch.load(record)
    held_ids = {t: [i for (tt, i) in saved["held"] if tt == t] for t in FEATURE}
    window_ids = {t: [e[0] for w in saved["windows"] for e in w[t]["window"]] for t in FEATURE}
    model = _model(world_size, policy=policy, optimizer=optimizer, seed=3)
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        assert ck.restore() == STEPS
    ids = {t: sorted(set(held_ids[t] + window_ids[t] + _edge_ids(world_size))) for t in FEATURE}
    ranks = _check_routing(model, ids)
    held = _check_slots(model, saved["held"], ranks, over)
    theirs = None
    if dcp_path:
        theirs = _model(world_size, policy=policy, optimizer=optimizer, seed=4, ours=False)
        state = theirs.dmp.state_dict()
        dcp.load(state, checkpoint_id=dcp_path)
        theirs.dmp.load_state_dict(state)
        from test_managed_collision import _looked_up

        mine, its = _looked_up(model, held), _looked_up(theirs, held)
        assert all(torch.equal(mine[k], its[k]) for k in held), "a held id's row differs from TorchRec's own load"
    _check_misses(model, held, theirs)
    _check_window(model, saved["windows"], ranks)
    _check_next_eviction(model, saved["windows"], ranks)
    if buckets:
        poked = _model(world_size, policy=policy, optimizer=optimizer, seed=6, buckets=buckets)
        with Checkpointer(poked.dmp, _config(root), dense_optimizer=poked.dense_optimizer) as ck:
            assert ck.restore() == STEPS
        ids = {t: sorted(set(held_ids[t] + _edge_ids(b))) for t, b in buckets.items()}
        poked_ranks = _check_routing(poked, ids)
        assert any(poked_ranks[t][i] != ranks[t][i] for t in FEATURE for i in held_ids[t]), (
            "these buckets send every held id to the rank one bucket per rank does")
        _check_slots(poked, saved["held"], poked_ranks, over=None)
        # TorchRec's default input size, int64's max: blocks as wide as int64 allows, no id past the last one.
        widest = _model(world_size, policy=policy, optimizer=optimizer, input_size=2**63 - 1)
        top = [2**62 - 1, 2**62, 2**62 + 1, 2**63 - 2, 3074457345618258602, 3074457345618258603]
        _check_routing(widest, {t: sorted(set(held_ids[t] + top)) for t in FEATURE})


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def saved_on_2(tmp_path_factory):
    """A checkpoint of 2 ranks (LFU, EXACT_SGD), its record, and TorchRec's own DCP checkpoint of the same state."""
    d = tmp_path_factory.mktemp("on2")
    out = (str(d / "ck"), str(d / "record.pt"), str(d / "dcp"))
    run_ranks(_save_job, world_size=2, timeout=150, args=(out[0], out[1], "lfu", "sgd", out[2]))
    return out


@pytest.mark.timeout(200)
def test_2_to_1_keeps_torchrecs_reserved_row_routing_and_window(group, saved_on_2):
    """2 -> 1: every held id fits. The reserved row and a held id's row equal TorchRec's own DCP load's."""
    root, record, dcp_path = saved_on_2
    _move_job(0, 1, root, record, "lfu", "sgd", False, dcp_path)


@pytest.mark.timeout(200)
def test_2_to_3_over_capacity_keeps_torchrecs_reserved_row_routing_and_window(saved_on_2):
    """2 -> 3: more held ids route to some rank than it has slots, and 4001 ids do not split evenly over 3."""
    root, record, _ = saved_on_2
    run_ranks(_move_job, world_size=3, timeout=180, args=(root, record, "lfu", "sgd", True))


@pytest.mark.timeout(240)
def test_1_to_2_over_capacity_and_buckets_above_the_world_size(group, tmp_path):
    """1 -> 2 (DistanceLFU, EXACT_ADAGRAD): over capacity; then onto modules with 4 and 3 buckets on 2 ranks,
    which TorchRec's input distribution lays out by position (3 is not a multiple of 2), past ids included."""
    root, record = str(tmp_path / "ck"), str(tmp_path / "record.pt")
    _save_job(0, 1, root, record, "distance_lfu", "adagrad", None)
    run_ranks(_move_job, world_size=2, timeout=200,
              args=(root, record, "distance_lfu", "adagrad", True, None, {"big": 4, "small": 3}))


def test_route_refuses_fewer_buckets_than_ranks():
    """TorchRec's input distribution asserts at least one bucket per rank; ``route`` refuses the same by name."""
    from cnr_torchrec.errors import UnsupportedShardingError
    from cnr_torchrec.track.managed_collision import route

    with pytest.raises(UnsupportedShardingError, match=r"buckets\(\) 2 on 3 ranks"):
        route(torch.tensor([0, 5]), INPUT, 3, 2)
