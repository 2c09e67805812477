"""The follower on managed-collision (sort-zch) tables: remapped and evicted ids follow each commit.

A 2-rank job of TorchRec's ManagedCollisionEmbeddingBagCollection and ManagedCollisionEmbeddingCollection
(``_mc_models``: skewed ids that make the modules evict every 2 steps) saves a baseline and lossless
deltas. At each save the trainer records, through TorchRec's own sharded forward in eval mode, the
embedding each held raw id looks up. After each commit the follower serves an unsharded model of the same
kind, and TorchRec's own unsharded forward must give every held raw id that same embedding, and remap
every id evicted since the save before to TorchRec's miss row (the table's last), never to its old row.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from _dist import run_ranks

SAVES = (1, 3, 5, 7)  # the steps after which the job saves: a baseline, then deltas across evictions


def _config(root):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "keep_last": 100, "memory_tier": "off",
                        "quantization": {"method": "none", "residual": False}})


def _job(rank, world_size, root, kind, out):
    import _mc_models as M
    from test_managed_collision import _held, _looked_up

    from cnr_torchrec import CheckNRunDMP, Checkpointer

    model = M.build_mc_model(kind, world_size, dmp_cls=CheckNRunDMP, eviction_interval=2, seed=0)
    batches = M.mc_batches(SAVES[-1] + 1, world_size, rank, seed=1, features=model.features)
    looked_up = []
    with Checkpointer(model.dmp, _config(root), dense_optimizer=model.dense_optimizer) as ck:
        for step, batch in enumerate(batches):
            M.train_step(model, batch)
            if step in SAVES:
                ck.save(step).wait()
                torch.distributed.barrier()
                if rank == 0:
                    shutil.copytree(root, os.path.join(out, str(len(looked_up))))
                looked_up.append(_looked_up(model, _held(model)))
    if rank == 0:
        torch.save(looked_up, os.path.join(out, "looked_up.pt"))


def _serving_model(kind):
    import _mc_models as M

    torch.manual_seed(9)
    tables = M.mc_tables(kind)
    return M.MCSparseModel(kind, tables, policy="lfu", eviction_interval=2, input_hash_size=4000).eval(), tables


def _lookups(serving, kind, tables, ids):
    """TorchRec's own unsharded forward of each ``(table, raw id)`` in ``ids``: ``{(table, id): (row, remapped
    row)}``, one id per sample of the table's first feature."""
    import _mc_models as M
    from torchrec import KeyedJaggedTensor

    mc = serving.mc_ebc if kind == "ebc" else serving.mc_ec
    mc._return_remapped_features = True
    out = {}
    for t in tables:
        mine = sorted(i for tt, i in ids if tt == t.name)
        if not mine:
            continue
        features = M.features_of(tables)
        lengths = [[1] * len(mine) if f == t.features[0] else [0] * len(mine) for f in features]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=features, values=torch.tensor(mine, dtype=torch.int64),
                                                  lengths=torch.tensor(sum(lengths, []), dtype=torch.int64))
        with torch.no_grad():
            embedded, remapped = mc(kjt)
        rows = embedded[t.features[0]].values() if kind == "ec" else embedded[t.features[0]]
        where = remapped[t.features[0]].values()
        out.update({(t.name, i): (rows[k], int(where[k])) for k, i in enumerate(mine)})
    return out


@pytest.fixture(scope="module", params=["ebc", "ec"])
def mc_job(request, tmp_path_factory):
    """(kind, the directory holding the root as it stood after each save and what the trainer looked up)."""
    base = tmp_path_factory.mktemp(f"mc-{request.param}")
    saved = str(base / "saved")
    os.mkdir(saved)
    run_ranks(_job, 2, args=(str(base / "job"), request.param, saved), timeout=240)
    return request.param, saved


@pytest.mark.timeout(300)
def test_a_follower_serves_each_held_id_as_the_trainer_looks_it_up_and_no_evicted_id(group, tmp_path, mc_job):
    from cnr_torchrec.publish import Follower

    kind, saved = mc_job
    root = str(tmp_path / "root")
    looked_up = torch.load(os.path.join(saved, "looked_up.pt"))
    serving, tables = _serving_model(kind)
    last_row = {t.name: t.rows - 1 for t in tables}
    evicted_seen = 0
    os.mkdir(root)
    with Follower(root, serving) as follower:
        for i, want in enumerate(looked_up):
            shutil.copytree(os.path.join(saved, str(i)), root, dirs_exist_ok=True)
            (update,) = follower.poll()
            assert update.how == ("reload" if i == 0 else "delta")
            got = _lookups(serving, kind, tables, want)
            for key, row in want.items():
                assert torch.equal(got[key][0], row), (i, key)
            if i:
                evicted = set(looked_up[i - 1]) - set(want)
                evicted_seen += len(evicted)
                moved = _lookups(serving, kind, tables, evicted)
                assert all(moved[key][1] == last_row[key[0]] for key in evicted), i
    assert evicted_seen > 0  # the job did evict between saves


def test_a_managed_collision_checkpoint_into_a_plain_table_is_refused_by_name(group, mc_job):
    from examples.toy import TableSpec, ToyModel

    from cnr_torchrec.errors import ConfigError
    from cnr_torchrec.publish import Follower

    kind, saved = mc_job
    dim = 8 if kind == "ec" else 4
    plain = ToyModel([TableSpec("big", 48, 8, "row_wise"), TableSpec("small", 32, dim, "row_wise")], device="cpu")
    with Follower(os.path.join(saved, "0"), plain) as follower:
        with pytest.raises(ConfigError, match="'big' is a managed-collision table in checkpoint 0 and not in the"):
            follower.poll()
