"""Per-rank parts (format 7): each rank reads what it needs, and a save leaves nothing in the c10d store.

Three gloo ranks save a baseline and deltas of the toy model (row-wise, table-wise and column-wise tables)
and restore them with every part read recorded:

- on the plan that saved, a rank reads its own part of each member of the chain and rank 0's part of the
  tip (the dense state), and asks the storage for the size of its own chunks only; it restores what the
  model held when it saved (weights diffed against the live model, every rank);
- after every save, the keys it created in the store (each rank's line, the outcome, its counter) are gone,
  and the store holds as many keys as before the save;
- a part that is missing is named by the rank that reads it: under ``on_corrupt: fail`` every rank raises
  CorruptCheckpointError naming it, and under ``fallback`` every rank restores the checkpoint before.
"""

from __future__ import annotations

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


def _recording(monkeypatch):
    """Records every part read and every size asked for, by path."""
    from cnr_torchrec.ckpt.format.storage import Storage

    seen: dict[str, list[str]] = {"read": [], "size": []}
    read, size = Storage.read, Storage.size

    def recorded_read(self, path, byte_range=None):
        seen["read"].append(path)
        return read(self, path, byte_range)

    def recorded_size(self, path):
        seen["size"].append(path)
        return size(self, path)

    monkeypatch.setattr(Storage, "read", recorded_read)
    monkeypatch.setattr(Storage, "size", recorded_size)
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

    fresh, fresh_opt, _ = _model(1)
    mp = pytest.MonkeyPatch()
    seen = _recording(mp)
    try:
        restorer = Checkpointer(fresh, _config(root), dense_optimizer=fresh_opt)
        assert restorer.restore() == 3
        restorer.close()
    finally:
        mp.undo()
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
