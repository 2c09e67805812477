"""Managed-collision (sort-zch) tables, checked against TorchRec's own modules and nothing written here:

* tracked rows against the weights, optimizer state and remapping state diffed across each step;
* a restore, then training on, against the uninterrupted run, bit for bit, on 1, 2 and 4 ranks;
* a restore onto another world size against the held raw ids before the move (and, 2 -> 1, against
  TorchRec's own DCP round trip);
* TestSparseNN's own ZCH variant (``zch_kwargs``).

The models are in ``_mc_models.py``: an MC-EBC (mixed dims, a table two features look up) or an MC-EC,
row_wise with fused EXACT_SGD or EXACT_ADAGRAD (what trains on CPU), fed skewed batches that make every
eviction interval evict.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

EMPTY = torch.iinfo(torch.int64).max

LONG = pytest.mark.long  # in `make reliability`: a faster case of the same test runs in `make test`


def _config(root, **kw):
    from cnr_torchrec import load_config

    # Lossless rows: every check below is bit for bit. Evictions re-initialise rows from the global RNG, so exact
    # continuation needs it restored too.
    return load_config({"root": root, "policy": "consecutive", "restore_rng": True,
                        "quantization": {"method": "none", "residual": False}, **kw})


def _build(kind, world_size, *, policy="lfu", optimizer="sgd", seed=0, interval=3, rows=(48, 32),
           device=torch.device("cpu")):
    import _mc_models as M

    from cnr_torchrec import CheckNRunDMP

    return M.build_mc_model(kind, world_size, policy=policy, optimizer=optimizer, dmp_cls=CheckNRunDMP,
                            eviction_interval=interval, seed=seed, zch_rows=rows, device=device)


def _batches(model, n, world_size, rank, device=torch.device("cpu")):
    import _mc_models as M

    return [b.to(device) for b in M.mc_batches(n, world_size, rank, seed=1, features=model.features)]


def _shard_rows(model, table):
    """This rank's rows of ``table``: (shard, weights, optimizer states as [rows, -1], by-row MC state)."""
    tracker = model.dmp.dirty_tracker
    (kernel, shard), = tracker.shards(table)
    weights = kernel.tbe.split_embedding_weights()[shard.local_index].detach().clone()
    states = kernel.tbe.split_optimizer_states()
    states = [s.detach().clone().reshape(shard.num_rows, -1) for s in (states[shard.local_index] if states else [])]
    return shard, weights, states, tracker.mc_table(table).by_row()


def changed_rows(before, after):
    """Global rows whose weights, optimizer state or by-row MC state differ between two :func:`_shard_rows`."""
    shard, w0, s0, mc0 = before
    _, w1, s1, mc1 = after
    changed = (w0 != w1).any(dim=1).cpu() | (mc0 != mc1).any(dim=1)
    for a, b in zip(s0, s1):
        changed |= (a != b).any(dim=1).cpu()
    return torch.nonzero(changed).view(-1) + shard.rows[0]


def _everything(model):
    """This rank's whole model state as TorchRec keeps it: the state_dict's local tensors (tables, MC buffers
    by sort position, dense), the optimizer states and each MC module's counters and eviction window."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in model.dmp.state_dict().items():
        if isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                out[(key, i)] = shard.tensor.detach().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
    for table in model.table_names:
        _, _, states, _ = _shard_rows(model, table)
        for j, s in enumerate(states):
            out[(table, "state", j)] = s
    for table, mch in model.mc_modules().items():
        n = mch._current_history_buffer_offset
        out[(table, "window")] = (mch._current_iter, mch._last_eviction_iter, n)
        if n:
            out[(table, "history")] = mch._history_accumulator[:n].clone()
    return out


def _differences(a, b):
    bad = []
    for key, x in a.items():
        y = b.get(key)
        same = (isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)) if isinstance(
            x, torch.Tensor) else x == y
        if not same:
            bad.append(key)
    return bad


# ----------------------------------------------------------------------------- tracking


def _tracking_worker(rank, world_size, kind, policy, optimizer):
    model = _build(kind, world_size, policy=policy, optimizer=optimizer)
    tracker = model.dmp.dirty_tracker
    evictions = 0
    for step, batch in enumerate(_batches(model, 10, world_size, rank)):
        before = {t: _shard_rows(model, t) for t in model.table_names}
        tracker.reset()
        import _mc_models as M

        M.train_step(model, batch)
        for table in model.table_names:
            after = _shard_rows(model, table)
            evictions += int((before[table][3] != after[3])[:-1].any())  # the last slot's moves at every eviction
            want, got = changed_rows(before[table], after), tracker.dirty_rows(table)
            # None missed, and none extra: every looked-up row's update is non-zero here.
            assert torch.equal(got, want), (rank, step, table, sorted(set(want.tolist()) ^ set(got.tolist())))
    assert evictions >= 4, "the fixture's batches no longer evict"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,policy,optimizer", [("ebc", "lfu", "adagrad"), ("ec", "lru", "sgd"),
                                                   pytest.param("ebc", "distance_lfu", "sgd", marks=LONG)])
def test_tracked_rows_are_the_rows_whose_weights_state_or_remapping_changed(kind, policy, optimizer):
    run_ranks(_tracking_worker, world_size=2, timeout=150, args=(kind, policy, optimizer))


# ----------------------------------------------------------------------------- exact continuation


def _continuation_worker(rank, world_size, root, kind, policy, optimizer, restore_at, total, rows):
    import _mc_models as M

    from cnr_torchrec import Checkpointer

    model = _build(kind, world_size, policy=policy, optimizer=optimizer, rows=rows)
    batches = _batches(model, total, world_size, rank)
    torch.manual_seed(1000 + rank)  # evictions re-initialise rows from the global RNG
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(batches):
            if step in (2, restore_at):  # a baseline, then a delta mid eviction window
                ck.save(step).wait()
            M.train_step(model, batch)
    uninterrupted = _everything(model)

    torch.manual_seed(7)  # another RNG stream, other initial weights: everything must come from the checkpoint
    other = _build(kind, world_size, policy=policy, optimizer=optimizer, seed=5, rows=rows)
    with Checkpointer(other.dmp, _config(root), dense_optimizer=other.dense_optimizer) as ck:
        assert ck.restore() == restore_at
        for batch in batches[restore_at:]:
            M.train_step(other, batch)
    assert restore_at % 3 != 0  # restored mid eviction window
    bad = _differences(uninterrupted, _everything(other))
    assert not bad, f"rank {rank}: {bad}"


# Tables that fill at the first eviction, and (the 512/256-row case) tables still part empty at the restore,
# whose empty slots' order decides where the next ids go.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,kind,policy,optimizer,rows", [
    (1, "ebc", "lfu", "adagrad", (48, 32)), (2, "ec", "lru", "sgd", (512, 256)),
    (2, "ebc", "distance_lfu", "adagrad", (48, 32)), pytest.param(4, "ebc", "lru", "sgd", (48, 32), marks=LONG),
])
def test_a_restore_continues_bit_for_bit_like_the_uninterrupted_job(tmp_path, world_size, kind, policy, optimizer,
                                                                    rows):
    run_ranks(_continuation_worker, world_size=world_size, timeout=200,
              args=(str(tmp_path / "ck"), kind, policy, optimizer, 7, 12, rows))


# ----------------------------------------------------------------------------- other world sizes


def _held(model):
    """Every rank's held raw ids: ``{(table, raw id): (weights, optimizer states, metadata)}``."""
    mine = {}
    for table in model.table_names:
        _, weights, states, mc = _shard_rows(model, table)
        for r in torch.nonzero(mc[:, 0] != EMPTY).view(-1).tolist():
            mine[(table, int(mc[r, 0]))] = (weights[r], [s[r] for s in states], mc[r, 1:])
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for p in parts for k, v in p.items()}


def _looked_up(model, held):
    """Each held raw id's embedding as TorchRec's own forward gives it (input dist, remap, lookup), in eval
    mode (no profiling, no eviction): ``{(table, raw id): row}``. Every rank asks for a share of the ids."""
    from torchrec import KeyedJaggedTensor

    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_table = {t: sorted(i for tt, i in held if tt == t) for t in model.table_names}
    feature = {t.name: t.features[0] for t in model.tables}
    batch = max(-(-len(ids) // world_size) for ids in per_table.values())
    mine = {}
    for t, ids in per_table.items():
        padded = ids + ids[-1:] * (batch * world_size - len(ids))
        mine[t] = padded[rank * batch:(rank + 1) * batch]
    values, lengths = [], []
    for f in model.features:
        table = next((t for t, ff in feature.items() if ff == f), None)
        ids = mine[table] if table is not None else []
        values += ids
        lengths += [1] * len(ids) if table is not None else [0] * batch
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=model.features, values=torch.tensor(values, dtype=torch.int64),
                                              lengths=torch.tensor(lengths, dtype=torch.int64))
    model.dmp.eval()
    with torch.no_grad():
        out, _ = model.sharded_mc(kjt)
    model.dmp.train()
    got = {}
    for t, ids in mine.items():
        rows = out[feature[t]].values() if model.kind == "ec" else out[feature[t]]
        got.update({(t, i): rows[k].clone() for k, i in enumerate(ids)})
    parts = [None] * world_size
    dist.all_gather_object(parts, got)
    return {k: v for p in parts for k, v in p.items()}


def _save_worker(rank, world_size, root, kind, policy, optimizer, held_path):
    import _mc_models as M

    from cnr_torchrec import Checkpointer

    model = _build(kind, world_size, policy=policy, optimizer=optimizer)
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(_batches(model, 10, world_size, rank)):
            if step in (3, 7):
                ck.save(step).wait()
            M.train_step(model, batch)
        ck.save(10).wait()
    held = _held(model)
    if rank == 0:
        torch.save(held, held_path)


def _moved_worker(rank, world_size, root, kind, policy, optimizer, held_path, log_path):
    import _mc_models as M

    from cnr_torchrec import Checkpointer

    handler = logging.FileHandler(f"{log_path}.{rank}")
    logging.getLogger("cnr_torchrec").addHandler(handler)
    model = _build(kind, world_size, policy=policy, optimizer=optimizer, seed=3)
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        ck.restore()
        before, after = torch.load(held_path), _held(model)
        assert set(after) <= set(before)
        for key in after:
            w, states, meta = before[key]
            w2, states2, meta2 = after[key]
            assert torch.equal(w, w2) and torch.equal(meta, meta2) and all(map(torch.equal, states, states2)), key
        # And TorchRec's own routing and remapping find each id there.
        for key, row in _looked_up(model, after).items():
            assert torch.equal(row, before[key][0]), key
        handler.flush()
        dropped = 0
        for r in range(world_size):
            with open(f"{log_path}.{r}") if os.path.exists(f"{log_path}.{r}") else open(os.devnull) as f:
                dropped += sum(int(line.rsplit("dropped ", 1)[1]) for line in f if "dropped" in line)
        assert len(before) - len(after) == dropped
        for step, batch in enumerate(_batches(model, 13, world_size, rank)[10:]):  # and trains on
            M.train_step(model, batch)
        ck.save(13).wait()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("before,after,kind,policy,optimizer", [
    pytest.param(2, 1, "ebc", "lfu", "adagrad", marks=LONG), (1, 2, "ec", "lru", "sgd"),
    pytest.param(4, 2, "ebc", "distance_lfu", "adagrad", marks=LONG),
])
def test_a_restore_onto_another_world_size_moves_rows_by_raw_id(tmp_path, before, after, kind, policy, optimizer):
    root, held, log = str(tmp_path / "ck"), str(tmp_path / "held.pt"), str(tmp_path / "log")
    run_ranks(_save_worker, world_size=before, timeout=120, args=(root, kind, policy, optimizer, held))
    run_ranks(_moved_worker, world_size=after, timeout=120, args=(root, kind, policy, optimizer, held, log))


# ----------------------------------------------------------------------------- DCP export


def _model_state(model):
    """This rank's ``dmp.state_dict()`` as local tensors (MC buffers by sort position, as TorchRec keeps them)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in model.dmp.state_dict().items():
        if isinstance(value, ShardedTensor):
            out[key] = torch.cat([s.tensor for s in value.local_shards()]).detach().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
    return out


def _export_save_worker(rank, world_size, root, kind, policy, optimizer, out):
    import _mc_models as M

    from cnr_torchrec import Checkpointer

    model = _build(kind, world_size, policy=policy, optimizer=optimizer)
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(_batches(model, 8, world_size, rank)):
            if step == 3:
                ck.save(step).wait()
            M.train_step(model, batch)
        ck.save(8).wait()
    torch.save(_model_state(model), f"{out}.{rank}")


def _export_load_worker(rank, world_size, path, kind, policy, optimizer, out):
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec.ckpt.tools.dcp import DMPLoadPlanner

    model = _build(kind, world_size, policy=policy, optimizer=optimizer, seed=4)
    dcp.load(model.dmp.state_dict(), checkpoint_id=path, planner=DMPLoadPlanner())
    want, got = torch.load(f"{out}.{rank}"), _model_state(model)
    mc = [k for k in want if "_managed_collision_modules" in k]
    assert len(mc) >= 8 and set(want) == set(got)
    assert not [k for k in want if not torch.equal(want[k], got[k])]


@pytest.mark.timeout(200)
def test_a_dcp_export_holds_the_mc_buffers_as_torchrec_names_and_shards_them(tmp_path):
    """``cnr export --format dcp``, then torch's own ``dcp.load`` into the same plan: every table and MC buffer
    (sorted raw ids, remapping, metadata, iteration counter, output segments) equals the live model's."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.dcp import export_dcp

    root, out, path = str(tmp_path / "ck"), str(tmp_path / "live"), str(tmp_path / "dcp")
    args = ("ebc", "distance_lfu", "adagrad")
    run_ranks(_export_save_worker, world_size=2, timeout=120, args=(root, *args, out))
    storage = Storage(root)
    try:
        export_dcp(storage, path)
    finally:
        storage.close()
    run_ranks(_export_load_worker, world_size=2, timeout=120, args=(path, *args, out))


# ----------------------------------------------------------------------------- compaction


def _compaction_worker(rank, world_size, root, quantization, offline_root):
    """Saves every step with background compaction (every 2 deltas), then restores the newest checkpoint, a
    compacted baseline's delta, and, from ``offline_root``, the same chain after ``cnr compact``."""
    import _mc_models as M

    from cnr_torchrec import Checkpointer, load_config

    model = _build("ebc", world_size, policy="distance_lfu", optimizer="sgd", rows=(64, 48))
    config = load_config({"root": root, "policy": "consecutive", "quantization": quantization,
                          "compaction": {"max_chain": 2}})
    batches = _batches(model, 9, world_size, rank)
    torch.manual_seed(50 + rank)
    with Checkpointer(model.dmp, config, dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(batches, start=1):
            M.train_step(model, batch)
            ck.save(step).wait()
            ck.wait(compaction=True)
        want = {t: (model.dmp.dirty_tracker.mc_table(t).by_row(), model.mc_modules()[t]._current_iter)
                for t in model.table_names}
        weights = {t: _shard_rows(model, t)[1] for t in model.table_names}
    dist.barrier()  # rank 0's last commit (and the retention that follows it) is done before the root is listed
    compacted = _compacted_ids(root)
    assert compacted, "no compaction ran"
    for where in (root, offline_root):
        other = _build("ebc", world_size, policy="distance_lfu", optimizer="sgd", rows=(64, 48), seed=2)
        config = load_config({"root": where, "policy": "consecutive", "quantization": quantization,
                              "restore_rng": True})
        with Checkpointer(other.dmp, config, dense_optimizer=other.dense_optimizer) as ck:
            assert ck.restore() == 9
            for t, (state, it) in want.items():
                assert torch.equal(other.dmp.dirty_tracker.mc_table(t).by_row(), state), (where, t)
                assert other.mc_modules()[t]._current_iter == it
                if quantization["method"] == "none":
                    assert torch.equal(_shard_rows(other, t)[1], weights[t]), (where, t)


def _compacted_ids(root):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.summary import summarize

    storage = Storage(root)
    try:
        return [c["id"] for c in summarize(storage)["checkpoints"] if c.get("compacted_from")]
    finally:
        storage.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("quantization", [{"method": "none", "residual": False},
                                          pytest.param({"method": "adaptive", "bits": 4, "residual": True}, marks=LONG)],
                         ids=["merge", "residual-fold"])
def test_compaction_keeps_the_remapping_state(tmp_path, quantization):
    """Background compaction (a lossless merge, or residual folds at 8 bits) and ``cnr compact`` carry every row's
    remapping state and each rank's eviction window into the new baseline."""
    import shutil

    from cnr_torchrec.cli import main

    root, offline = str(tmp_path / "ck"), str(tmp_path / "offline")

    run_ranks(_save_for_offline_worker, world_size=2, timeout=120, args=(root, quantization))
    shutil.copytree(root, offline)
    assert main(["compact", offline]) == 0
    shutil.rmtree(root)
    run_ranks(_compaction_worker, world_size=2, timeout=200, args=(root, quantization, offline))


def _save_for_offline_worker(rank, world_size, root, quantization):
    """The job of :func:`_compaction_worker` without compaction: a plain chain, for ``cnr compact``."""
    import _mc_models as M

    from cnr_torchrec import Checkpointer, load_config

    model = _build("ebc", world_size, policy="distance_lfu", optimizer="sgd", rows=(64, 48))
    config = load_config({"root": root, "policy": "consecutive", "quantization": quantization})
    torch.manual_seed(50 + rank)
    with Checkpointer(model.dmp, config, dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(_batches(model, 9, world_size, rank), start=1):
            M.train_step(model, batch)
            ck.save(step).wait()


# ----------------------------------------------------------------------------- crafted manifests


@pytest.mark.timeout(600)
def test_every_field_of_a_crafted_mc_manifest_is_refused_by_name_or_harmless(group, tmp_path):
    """The mutation suite of test_manifest_schema.py on a delta of a managed-collision model: its ``mc`` entries
    and ``mc_runtime`` trees included."""
    import json

    import _mc_models as M
    from _format_checks import put_back, read_combined_at, snapshot_dir
    from test_manifest_schema import _fields, crafted_outcomes

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.format.commits import manifest_path

    root = str(tmp_path / "root")
    model = _build("ebc", 1, policy="distance_lfu", optimizer="adagrad")
    with Checkpointer(model.dmp, _config(root, on_corrupt="fail"), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(_batches(model, 5, 1, 0)):
            if step in (2, 4):
                info = ck.save(step).wait()
            M.train_step(model, batch)
    path = os.path.join(root, manifest_path(info.id))
    files = snapshot_dir(path)
    body = read_combined_at(path)  # the rank's part under ranks
    assert body["kind"] == "delta" and body["ranks"][0]["mc_runtime"]

    fresh = _build("ebc", 1, policy="distance_lfu", optimizer="adagrad", seed=1)
    restorer = Checkpointer(fresh.dmp, _config(root, on_corrupt="fail"), dense_optimizer=fresh.dense_optimizer)
    assert restorer.restore() == 4
    want = _everything(fresh)
    mc_fields = [fv for fv in _fields(body) if "mc" in "".join(map(str, fv[0]))]
    outcomes, problems = crafted_outcomes(body, path, restorer.restore, lambda: _everything(fresh), want,
                                          mc_fields)
    put_back(files)
    restorer.close()
    assert not problems, "\n".join(problems[:15])
    assert outcomes["named"] > 20, outcomes


def _import_worker(rank, world_size, path, root):
    """The 2-rank export onto 1 rank twice: restored by cnr from its import, and loaded by TorchRec itself (dcp.load
    of the state_dict, then load_state_dict, whose hook re-sorts the buffers)."""
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.tools.dcp import DMPLoadPlanner

    ours = _build("ebc", 1, policy="distance_lfu", optimizer="adagrad", seed=7)
    with Checkpointer(ours.dmp, _config(root), dense_optimizer=ours.dense_optimizer) as ck:
        ck.restore()
    theirs = _build("ebc", 1, policy="distance_lfu", optimizer="adagrad", seed=8)
    sd = theirs.dmp.state_dict()
    dcp.load(sd, checkpoint_id=path, planner=DMPLoadPlanner())
    theirs.dmp.load_state_dict(sd)
    held = 0
    for table in ours.table_names:
        _, w1, _, mc1 = _shard_rows(ours, table)
        _, w2, _, mc2 = _shard_rows(theirs, table)
        assert torch.equal(mc1, mc2) and torch.equal(w1, w2), table
        held += int((mc1[:, 0] != EMPTY).sum())
        assert (ours.mc_modules()[table]._current_iter_tensor == theirs.mc_modules()[table]._current_iter_tensor).all()
    assert held > 40


@pytest.mark.timeout(200)
def test_an_import_of_a_dcp_export_restores_what_torchrecs_own_load_gives(tmp_path):
    """2 ranks -> ``cnr export --format dcp`` -> ``cnr import-dcp`` -> restore on 1 rank, against TorchRec's own
    load of the same export onto 1 rank (which works this way round): the same rows, remapping and counter."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.dcp import export_dcp, import_dcp

    root, out, path, imported = (str(tmp_path / n) for n in ("ck", "live", "dcp", "imported"))
    run_ranks(_export_save_worker, world_size=2, timeout=120, args=(root, "ebc", "distance_lfu", "adagrad", out))
    for where, act in ((root, lambda s: export_dcp(s, path)), (imported, lambda s: import_dcp(path, s))):
        storage = Storage(where)
        try:
            act(storage)
        finally:
            storage.close()
    run_ranks(_import_worker, world_size=1, timeout=120, args=(path, imported))


# ----------------------------------------------------------------------------- CPR partial recovery


def _clobber(model):
    """What a replaced rank starts from, in this process: zero rows, empty tables, a fresh eviction window."""
    from cnr_torchrec.ckpt.tools.dcp.mc import fresh_window
    from cnr_torchrec.track.managed_collision import empty_state

    with torch.no_grad():
        for table in model.table_names:
            mc = model.dmp.dirty_tracker.mc_table(table)
            (kernel, shard), = model.dmp.dirty_tracker.shards(table)
            kernel.tbe.split_embedding_weights()[shard.local_index].zero_()
            mc.load_by_row(empty_state(mc.num_rows, len(mc.fields)))
            mc.load_runtime(fresh_window(mc.fields, 0))


def _partial_worker(rank, world_size, root):
    """Rank 1 fails after a save (its state clobbered, in process): it reloads its MC tables' rows, remapping and
    eviction window as saved, while rank 0 keeps its live ones; both train on."""
    import _mc_models as M

    from cnr_torchrec import Checkpointer

    model = _build("ec", world_size, policy="lru", optimizer="adagrad")
    batches = _batches(model, 8, world_size, rank)
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(batches[:6]):
            if step in (2, 4):
                at_save = _everything(model)
                ck.save(step).wait()
            M.train_step(model, batch)
        live = _everything(model)
        assert at_save[("big", "window")] != live[("big", "window")]
        if rank == 1:
            _clobber(model)
        ck.recover([1])
        got = _everything(model)
        if rank == 0:  # the survivor keeps everything it had
            assert not _differences(live, got)
        else:  # the replaced rank gets its rows, optimizer state, remapping and window as saved at step 4
            tables = {k: v for k, v in at_save.items() if "dense" not in str(k)}
            assert not _differences(tables, got), _differences(tables, got)
        for batch in batches[6:]:
            M.train_step(model, batch)


@pytest.mark.timeout(200)
def test_partial_recovery_reloads_the_failed_ranks_remapping_and_window(tmp_path):
    run_ranks(_partial_worker, world_size=2, timeout=150, args=(str(tmp_path / "ck"),))
