"""Per-rank parts (format 7): each rank reads what it needs, and a save leaves nothing in the c10d store.

Three gloo ranks save a baseline and deltas of the toy model (row-wise, table-wise and column-wise tables)
and restore them with every part read recorded:

- on the plan that saved, a rank reads its own part of each member of the chain and rank 0's part of the
  tip (the dense state), and asks the storage for the size of its own chunks only; it restores what the
  model held when it saved (weights diffed against the live model, every rank);
- after every save, the keys it created in the store (each rank's line, the outcome, its counter) are gone,
  and the store holds as many keys as before the save;
- a part that is missing is named by the rank that reads it: under ``on_corrupt: fail`` every rank raises
  CorruptCheckpointError naming it, and under ``fallback`` every rank restores the checkpoint before;
- onto another world size (4 ranks saved a row-wise table, 2 restore it), each rank reads the parts of the
  ranks whose rows it now holds, and holds the rows the 4 ranks' live models held when they saved.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from _dist import run_ranks
from _toy import build_dmp, local_state, train

pytestmark = pytest.mark.multirank

WORLD = 3


def _model(seed):
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 96, 8, "row_wise"), TableSpec("t1", 40, 4, "table_wise"),
             TableSpec("t2", 48, 12, "column_wise")]
    dmp, opt = build_dmp(specs, seed=seed)
    return dmp, opt, specs


def _config(root, on_corrupt="fail"):
    from cnr_torchrec import load_config

    return load_config({"root": root, "quantization": {"method": "none"}, "on_corrupt": on_corrupt,
                        "memory_tier": "off", "compaction": None})


def _restore_recording(dmp, opt, root, step):
    """Restores ``root`` into ``dmp`` (expecting ``step``), recording every read and every size asked for, by path."""
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    seen: dict[str, list[str]] = {"read": [], "size": []}
    read, size = Storage.read, Storage.size

    def recorded_read(self, path, byte_range=None):
        seen["read"].append(path)
        return read(self, path, byte_range)

    def recorded_size(self, path):
        seen["size"].append(path)
        return size(self, path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Storage, "read", recorded_read)
        mp.setattr(Storage, "size", recorded_size)
        ck = Checkpointer(dmp, _config(root), dense_optimizer=opt)
        assert ck.restore() == step
        ck.close()
    return seen


def _save_and_restore(rank, world_size, root):
    import torch.distributed as dist

    from cnr_torchrec import Checkpointer

    dmp, opt, specs = _model(0)
    ck = Checkpointer(dmp, _config(root), dense_optimizer=opt)
    base = dist.distributed_c10d._get_default_store()
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, 4):
        train(dmp, specs, opt, 2, gen)
        dist.barrier()
        before = base.num_keys()
        info = ck.save(step).wait()
        dist.barrier()
        keys = [f"{info.id}/report/{r}" for r in range(1, world_size)] + [f"{info.id}/result", f"{info.id}/heard"]
        left = [k for k in keys if ck._store.check([k])]
        assert not left, (rank, left)
        assert base.num_keys() == before, (rank, before, base.num_keys())
    want = local_state(dmp)
    ck.close()
    with open(os.path.join(root, f"ckpt-00000002/rank-{rank:05d}.json")) as f:  # the codec said once, in the part
        raw = json.load(f)
    assert raw["meta"]["method"] == "none" and all(set(e["weights"]["meta"]) <= {"dim", "num_rows"}
                                                   for es in raw["tables"].values() for e in es)

    fresh, fresh_opt, _ = _model(1)
    seen = _restore_recording(fresh, fresh_opt, root, 3)
    got = local_state(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
    parts = sorted(set(p for p in seen["read"] if p.endswith(".json") and "/rank-" in p))
    mine = {f"ckpt-{i:08d}/rank-{rank:05d}.json" for i in range(3)} | {"ckpt-00000002/rank-00000.json"}
    assert set(parts) == mine, (rank, parts)
    others = [p for p in seen["size"] if re.search(r"rank-(\d+)", p) and f"rank-{rank:05d}" not in p]
    assert not others, (rank, others)


@pytest.mark.timeout(240)
def test_a_rank_reads_its_own_parts_and_the_store_keeps_nothing(tmp_path):
    run_ranks(_save_and_restore, WORLD, timeout=200, args=(str(tmp_path / "root"),))


def _missing_part(rank, world_size, root, phase, on_corrupt):
    from cnr_torchrec import Checkpointer, CorruptCheckpointError

    dmp, opt, specs = _model(0)
    if phase == "save":
        ck = Checkpointer(dmp, _config(root), dense_optimizer=opt)
        gen = torch.Generator().manual_seed(rank)
        for step in (1, 2):
            train(dmp, specs, opt, 2, gen)
            ck.save(step).wait()
        ck.close()
        return
    ck = Checkpointer(dmp, _config(root, on_corrupt), dense_optimizer=opt)
    if on_corrupt == "fail":
        with pytest.raises(CorruptCheckpointError, match=r"ckpt-00000001/rank-00002\.json is missing"):
            ck.restore()
    else:
        assert ck.restore() == 1
    ck.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("on_corrupt", ["fail", "fallback"])
def test_a_missing_part_is_named_by_the_rank_that_reads_it(tmp_path, on_corrupt):
    root = str(tmp_path / "root")
    run_ranks(_missing_part, WORLD, timeout=200, args=(root, "save", on_corrupt))
    os.remove(os.path.join(root, "ckpt-00000001", "rank-00002.json"))
    run_ranks(_missing_part, WORLD, timeout=200, args=(root, "restore", on_corrupt))


def _row_wise(world_size, seed):
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 96, 8, "row_wise"), TableSpec("t1", 64, 4, "row_wise")]
    dmp, opt = build_dmp(specs, seed=seed)
    return dmp, opt, specs


def _rows_of(dmp):
    """{table: (global row range, weights)} of this rank's shards."""
    t = dmp.dirty_tracker
    return {name: (s.rows, k.tbe.split_embedding_weights()[s.local_index].detach().clone())
            for name in t.tables() for k, s in t.shards(name)}


def _save_on_four(rank, world_size, root, side):
    from cnr_torchrec import Checkpointer

    dmp, opt, specs = _row_wise(world_size, 0)
    ck = Checkpointer(dmp, _config(root), dense_optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    for step in (1, 2):
        train(dmp, specs, opt, 2, gen)
        ck.save(step).wait()
    ck.close()
    torch.save(_rows_of(dmp), os.path.join(side, f"rows{rank}.pt"))  # what the live model holds


def _restore_on_two(rank, world_size, root, side):
    import glob

    dmp, opt, _ = _row_wise(world_size, 1)
    seen = _restore_recording(dmp, opt, root, 2)
    saved = [torch.load(p) for p in sorted(glob.glob(os.path.join(side, "rows*.pt")))]
    for table, (rows, got) in _rows_of(dmp).items():
        want = torch.cat([w for s in saved for (r, w) in [s[table]] if rows[0] <= r[0] and r[1] <= rows[1]])
        assert torch.equal(got, want), (rank, table)
    parts = {p for p in seen["read"] if p.endswith(".json") and "/rank-" in p}
    # 96 and 64 rows in blocks of 24 and 16 on 4 ranks, of 48 and 32 on 2: rank r holds saved ranks 2r and 2r + 1.
    mine = {f"ckpt-{i:08d}/rank-{r:05d}.json" for i in (0, 1) for r in (2 * rank, 2 * rank + 1)}
    assert mine <= parts <= mine | {"ckpt-00000001/rank-00000.json"}, (rank, sorted(parts))  # + the tip's dense


@pytest.mark.timeout(300)
def test_onto_another_world_size_a_rank_reads_the_parts_that_hold_its_rows(tmp_path):
    root, side = str(tmp_path / "root"), str(tmp_path / "side")
    os.makedirs(side)
    run_ranks(_save_on_four, 4, timeout=200, args=(root, side))
    run_ranks(_restore_on_two, 2, timeout=200, args=(root, side))
