"""Only the coordinator deletes files whose fate is unknown (issue 43, part 1).

Under a launcher whose c10d store lives in rank 0's process (``init_method="tcp://..."`` or ``env://``
as srun and mpirun jobs start gloo, not torchrun's agent store), rank 0 is SIGKILLed at the fault
point ``commit.after_manifest`` of the second save: the manifest is in place, so the checkpoint is
committed, and rank 1 loses the store before it hears the verdict. Rank 1 must keep its file: the
committed checkpoint then verifies (``cnr verify``'s ``verify_root``, every checksum) and a fresh
restore takes it. Before the fix rank 1 removed its payload, and the committed checkpoint was lost
for good.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket

import pytest
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["CNR_FAULT"] = "commit.after_manifest:rank=0:nth=2"
    from cnr_torchrec.ckpt import fault_injection as faults

    faults.configure()
    # The store is hosted by rank 0's process, as env:// and tcp:// launches host it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    from _toy import build_dmp, train

    from cnr_torchrec import Checkpointer, SaveFailedError, load_config
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(rank)
    config = load_config({"root": root, "quantization": {"method": "none"}, "save_timeout_s": 20,
                          "memory_tier": "off"})
    ck = Checkpointer(dmp, config, dense_optimizer=opt)
    train(dmp, specs, opt, 1, gen)
    ck.save(1).wait()
    train(dmp, specs, opt, 1, gen)
    try:
        ck.save(2).wait()  # rank 0 dies inside it, after its manifest is in place
        outcome = "committed"
    except SaveFailedError as e:
        outcome = str(e)
    with open(out, "w") as f:
        json.dump({"rank": rank, "outcome": outcome}, f)
    os._exit(0)  # the group cannot be torn down without rank 0


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_a_rank_that_loses_rank_0_after_its_commit_keeps_its_files(group, tmp_path):
    import sys

    from _toy import build_dmp

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.format.commits import rank_file
    from cnr_torchrec.ckpt.tools.verify import verify_root
    from examples.toy import TableSpec

    root = str(tmp_path / "root")
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    sys_path = os.pathsep.join(sys.path)
    os.environ["PYTHONPATH"] = sys_path  # the spawned ranks find tests/_toy.py and examples/
    procs = [ctx.Process(target=_rank, args=(r, 2, port, root, str(tmp_path / f"rank{r}.json"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[0].exitcode == -9, procs[0].exitcode  # the fault fired
    assert procs[1].exitcode == 0, procs[1].exitcode
    with open(tmp_path / "rank1.json") as f:
        told = json.load(f)["outcome"]
    assert "no word from rank 0" in told and "keeps its files" in told, told

    assert committed_ids_of(root) == [0, 1]
    assert os.path.exists(os.path.join(root, rank_file(1, 1)))  # rank 1's payload of the committed checkpoint
    assert verify_root(root) == []  # every file of every committed checkpoint, every checksum

    # A fresh job (one rank here) restores the checkpoint rank 0 committed as it died.
    dmp, opt = build_dmp([TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")])
    config = load_config({"root": root, "on_corrupt": "fail", "memory_tier": "off"})
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        assert ck.restore() == 2


def committed_ids_of(root: str) -> list[int]:
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids

    storage = Storage(root, {})
    try:
        return sorted(committed_ids(storage))
    finally:
        storage.close()
