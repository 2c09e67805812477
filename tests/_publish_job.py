"""The training job whose roots the publishing tests follow, and what they compare the served tables with.

A 2-rank job of the toy model (pooled and sequence tables, every sharding type, TorchRec's
EXACT_ROWWISE_ADAGRAD) saves residual deltas, then a new baseline and a delta on it; after each commit
its root is copied aside, so a follower can be shown the root as it stood after each one. The reference is
what ``Checkpointer.restore()`` of a checkpoint gives a sharded model (restored on 1 rank, its shards then
whole tables), not the follower's own chain reader.
"""

from __future__ import annotations

import os
import shutil

import torch

from _dist import run_ranks
from _toy import build_dmp, train

SAVES = (("consecutive", 1), ("consecutive", 2), ("consecutive", 3), ("full", 4), ("consecutive", 5))
"""(policy, step) of each save: a baseline and two residual deltas, then a new baseline and a delta on it."""


def specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 48, 8, "column_wise"),
            TableSpec("t2", 40, 4, "table_wise"), TableSpec("t3", 32, 4, "data_parallel"),
            TableSpec("s0", 56, 8, "row_wise", "ec")]


def config(root, policy="consecutive"):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": policy, "keep_last": 100, "memory_tier": "off"})


def _train_and_save(rank, world_size, root, snapshots):
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(specs(), seed=0)
    gen = torch.Generator().manual_seed(rank)
    ck, policy = None, None
    for i, (want, step) in enumerate(SAVES):
        if want != policy:  # a job restarted with another policy: it restores, then goes on
            if ck is not None:
                ck.close()
            ck, policy = Checkpointer(dmp, config(root, want), dense_optimizer=opt), want
            if i:
                ck.restore()
        train(dmp, specs(), opt, 2, gen)
        ck.save(step).wait()
        torch.distributed.barrier()
        if rank == 0:
            shutil.copytree(root, os.path.join(snapshots, str(i)))
        torch.distributed.barrier()
    ck.close()


def saved_roots(base):
    """A 2-rank job's root as it stood after each save, by save index (copies under ``base``)."""
    root, snapshots = str(base / "root"), str(base / "snapshots")
    os.mkdir(snapshots)
    run_ranks(_train_and_save, 2, args=(root, snapshots), timeout=300)
    return [os.path.join(snapshots, str(i)) for i in range(len(SAVES))]


def show(snapshot, root):
    """The follower's root becomes the root as it stood at ``snapshot`` (files only ever added, as by commits)."""
    shutil.copytree(snapshot, root, dirs_exist_ok=True)


def restored_tables(root):
    """Each table of the newest checkpoint under ``root`` as a sharded model's restore gives it (on 1 rank)."""
    return restored(root)[0]


def restored(root):
    """The newest checkpoint under ``root`` as a sharded model's restore gives it (on 1 rank): its tables by name,
    and its dense parameters and buffers by the model's state_dict names."""
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(specs(), seed=5)
    with Checkpointer(dmp, config(root), dense_optimizer=opt) as ck:
        ck.restore()
    dense = {k: v.detach().clone() for k, v in dmp.state_dict().items() if k.startswith("dense.")}
    tracker = dmp.dirty_tracker
    out = {}
    for t in tracker.tables():
        shards = tracker.shards(t)
        rows = max(s.rows[1] for _, s in shards)
        dim = max(s.cols[1] for _, s in shards)
        whole = torch.full((rows, dim), float("nan"))
        for k, s in shards:  # a column-wise table is several shards, on one rank too
            whole[s.rows[0] : s.rows[1], s.cols[0] : s.cols[1]] = k.tbe.split_embedding_weights()[s.local_index]
        out[t] = whole
    return out, dense


def served(model):
    """The float tables of an unsharded toy model, by name."""
    tables = {t: e.weight.detach() for t, e in model.ebc.embedding_bags.items()}
    return tables | {t: e.weight.detach() for t, e in model.ec.embeddings.items()}


def serving_model():
    from examples.toy import ToyModel

    torch.manual_seed(9)
    return ToyModel(specs(), device="cpu")  # unsharded: what a server builds


def assert_serves(model, root):
    """Every table ``model`` serves, and its dense layer, equal the restore of the newest checkpoint under
    ``root``."""
    want, dense = restored(root)
    got = served(model)
    assert set(got) <= set(want)
    for t in got:
        assert torch.equal(got[t], want[t]), (t, float((got[t] - want[t]).abs().max()))
    mine = {k: v for k, v in model.state_dict().items() if k.startswith("dense.")}
    assert mine.keys() == dense.keys() and all(torch.equal(mine[k], dense[k]) for k in dense)
