"""The job's DLRM with tables shared by several features, on 2 gloo ranks.

The job test (test_train.py) already resumes this model bit for bit on the same plan. Here
the tracked rows are checked against the weights diffed before and after each step and
against the ids each table was looked up with, and an fp32 chain is restored onto one rank
with every table on another sharding type.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks

pytestmark = pytest.mark.multirank

# cat_0/cat_1 and cat_2/cat_3/cat_4 share a table; cat_2's cardinality makes its table row_wise.
DATA = {"scale": 0.0005, "min_rows": 16, "batch_size": 32}
SHARED = (("cat_0", "cat_1"), ("cat_2", "cat_3", "cat_4"))
FEATURES = [f"cat_{i}" for i in range(26)]
DIM = 8


def _build(world_size: int, row_wise_min_rows: int, seed: int = 0):
    """The job's model, plan and optimizers; also each table's rows and features, from the config."""
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP

    from cnr_dlrm.data import DataConfig, SyntheticCriteo
    from cnr_dlrm.dlrm import ModelConfig, build_model, build_plan, dense_parameters, make_sharder, table_features

    stream = SyntheticCriteo(DataConfig(**DATA))
    cfg = ModelConfig(embedding_dim=DIM, dense_arch_layer_sizes=(16, DIM), over_arch_layer_sizes=(16, 1),
                      row_wise_min_rows=row_wise_min_rows, init_seed=seed, shared_tables=SHARED)
    model = build_model(cfg, stream.table_rows, FEATURES, torch.device("cpu"))
    sharder = make_sharder("rowwise_adagrad", 0.05)
    plan = build_plan(model, sharder, world_size, row_wise_min_rows)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=plan, sharders=[sharder])
    dense = [p for _, p in dense_parameters(dmp, dmp.dirty_tracker.module_fqns())]
    return dmp, stream, torch.optim.Adagrad(dense, lr=0.05), table_features(cfg, stream.table_rows, FEATURES)


def _whole_tables(dmp, tables) -> dict[str, torch.Tensor]:
    """Whole tables from every rank's shards: the weights, and the row-wise Adagrad state as one more column."""
    out = {}
    for t, (rows, _) in tables.items():
        full = torch.zeros(rows, DIM + 1, dtype=torch.float64)
        for k, s in dmp.dirty_tracker.shards(t):
            full[s.rows[0]:s.rows[1], :DIM] = k.tbe.split_embedding_weights()[s.local_index].double()
            full[s.rows[0]:s.rows[1], DIM] = k.tbe.split_optimizer_states()[s.local_index][0].double()
        dist.all_reduce(full)
        out[t] = full
    return out


def _tracked_everywhere(tracker, table: str, rows: int) -> torch.Tensor:
    """The rows of ``table`` any rank tracked, sorted."""
    mask = torch.zeros(rows, dtype=torch.int32)
    mask[tracker.dirty_rows(table)] = 1
    dist.all_reduce(mask)
    return torch.nonzero(mask).flatten()


def _train_and_save_worker(rank, world_size, root, ref_path):
    from cnr_torchrec import Checkpointer, load_config

    dmp, stream, opt, tables = _build(world_size, row_wise_min_rows=100)
    tracker = dmp.dirty_tracker
    assert tables["t_cat_0"][1] == ["cat_0", "cat_1"] and tables["t_cat_2"][1] == ["cat_2", "cat_3", "cat_4"]
    assert {tracker.sharding_type(t) for t in ("t_cat_0", "t_cat_2")} == {"table_wise", "row_wise"}
    ckpt = Checkpointer(dmp, load_config({"root": root, "policy": "consecutive", "quantization": {"method": "none"}}),
                        dense_optimizer=opt)
    bs = DATA["batch_size"]
    for step in range(4):
        # Every rank's batch, so that the ids each table was looked up with are known here.
        batches = [stream.batch(r, step * bs, (step + 1) * bs) for r in range(world_size)]
        before = _whole_tables(dmp, tables)
        loss, _ = dmp(batches[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = _whole_tables(dmp, tables)
        inputs = [b.sparse_features.to_dict() for b in batches]
        for t, (rows, features) in tables.items():
            looked_up = torch.unique(torch.cat([kjt[f].values() for kjt in inputs for f in features]))
            changed = torch.nonzero((after[t] != before[t]).any(dim=1)).flatten()
            tracked = _tracked_everywhere(tracker, t, rows)
            assert torch.equal(tracked, looked_up), t
            assert torch.equal(changed, tracked), t
        ckpt.save(step).wait()
    ckpt.close()
    ref = _whole_tables(dmp, tables)
    if rank == 0:
        torch.save(ref, ref_path)


def _restore_worker(rank, world_size, root, ref_path):
    from cnr_torchrec import Checkpointer, load_config

    # One rank, every table whole on it (table_wise): another plan and world size.
    dmp, _, opt, tables = _build(world_size, row_wise_min_rows=10**9, seed=7)
    assert {dmp.dirty_tracker.sharding_type(t) for t in tables} == {"table_wise"}
    Checkpointer(dmp, load_config({"root": root, "policy": "consecutive", "quantization": {"method": "none"}}),
                 dense_optimizer=opt).restore()
    ref = torch.load(ref_path, weights_only=True)
    got = _whole_tables(dmp, tables)
    assert got.keys() == ref.keys()
    for t in ref:
        assert torch.equal(got[t], ref[t]), t


@pytest.mark.timeout(300)
def test_dlrm_with_shared_tables_tracks_exactly_and_restores_onto_another_plan(tmp_path):
    ref = str(tmp_path / "ref.pt")
    run_ranks(_train_and_save_worker, world_size=2, timeout=200, args=(str(tmp_path / "ck"), ref))
    run_ranks(_restore_worker, world_size=1, timeout=120, args=(str(tmp_path / "ck"), ref))
