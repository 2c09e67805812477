"""CPR partial recovery: Checkpointer.recover(failed_ranks) on 2 ranks, with a failure simulated in process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks
from tests.test_checkpointer_multirank import _build, _config, _local_state, _train

pytestmark = pytest.mark.multirank


class Reader:
    """A stand-in for a StatefulDataLoader: its position is per-rank state."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self):
        return {"position": torch.tensor(self.position)}

    def load_state_dict(self, state):
        self.position = int(state["position"])


def _clobber(dmp, opt, reader) -> None:
    """What a replaced process starts from: other weights, no optimizer state, a reader at 0."""
    tracker = dmp.dirty_tracker
    with torch.no_grad():
        for t in tracker.tables():
            for k, s in tracker.shards(t):
                k.tbe.split_embedding_weights()[s.local_index].uniform_(-1, 1)
                if hasattr(k.tbe, "split_optimizer_states"):
                    for st in k.tbe.split_optimizer_states()[s.local_index]:
                        st.zero_()
        for n, p in dmp.named_parameters():
            if n.startswith("dense") or n.startswith("module.dense"):
                p.add_(1.0)
    opt.state.clear()
    reader.position = 0
    tracker.reset(baseline=True)


def _dense_state(dmp, opt):
    params = {n: p.detach().clone() for n, p in dmp.named_parameters() if "dense" in n}
    states = [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]
    return params, states


def _worker(rank, world_size, root):
    from cnr_torchrec import Checkpointer, ConfigError

    dmp, specs, opt = _build(world_size)
    reader = Reader()
    ck = Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt,
                      extra_state={"reader": reader})
    gen = torch.Generator().manual_seed(rank)
    for step in (1, 2, 3):
        _train(dmp, specs, opt, 2, gen)
        reader.position = 100 * step + rank
        ck.save(step).wait()
    at_checkpoint = _local_state(dmp)
    _train(dmp, specs, opt, 2, gen)  # progress after the checkpoint: kept by the survivor, lost by the failed rank
    reader.position = 999
    live = _local_state(dmp)

    for bad in ([], [0, 1], [2]):
        with pytest.raises(ConfigError, match="recover"):
            ck.recover(bad)

    if rank == 1:
        _clobber(dmp, opt, reader)
    info = ck.recover([1])
    assert (info.step, info.failed_ranks) == (3, (1,))
    got = _local_state(dmp)
    tables = {k for k in got if isinstance(k, tuple)}
    data_parallel = {k for k in tables if dmp.dirty_tracker.is_data_parallel(k[0])}
    for key in tables - data_parallel:
        want = at_checkpoint[key] if rank == 1 else live[key]  # the failed rank rolls back; the survivor does not
        assert torch.equal(got[key], want), (rank, key)
    assert reader.position == (301 if rank == 1 else 999)

    # Replicated state is the survivor's live state on both ranks, including the dense optimizer.
    params, states = _dense_state(dmp, opt)
    for name in sorted(params):
        ref = params[name].clone()
        dist.broadcast(ref, src=0)
        assert torch.equal(params[name], ref), name
    for key in data_parallel:
        assert torch.equal(got[key], live[key] if rank == 0 else got[key])
        ref = got[key].clone()
        dist.broadcast(ref, src=0)
        assert torch.equal(got[key], ref)
    for st in states:
        for k, v in st.items():
            ref = v.clone()
            dist.broadcast(ref, src=0)
            assert torch.equal(v, ref), k

    # Only the failed rank read, and only its own shards (plus rank 0's dense optimizer blobs).
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.checked_chain import load_chain

    storage = Storage(root)
    chain = load_chain(storage, info.ckpt_id, verify=False)
    own = sum(m.ranks[1].nbytes for m in chain)
    first = chain[-1].ranks[0]
    opt_bytes = sum(b.nbytes for n, b in first.blobs.items() if n.startswith("dense_optimizer"))
    everything = sum(m.nbytes for m in chain)
    assert 0 < info.bytes_read <= own + opt_bytes < everything, (info.bytes_read, own, opt_bytes, everything)

    # The chain goes on: the next delta holds the survivor's rows changed since the checkpoint, and a
    # full restore of it equals the live model.
    _train(dmp, specs, opt, 1, gen)
    assert ck.save(4).wait().kind == "delta"
    ck.close()
    final = _local_state(dmp)
    fresh, _, opt2 = _build(world_size, seed=3)
    restorer = Checkpointer(fresh, _config(root, "consecutive", "none", None), dense_optimizer=opt2,
                            extra_state={"reader": Reader()})
    assert restorer.restore() == 4
    again = _local_state(fresh)
    for key in final:
        assert torch.equal(again[key], final[key]), (rank, key)
    assert restorer.restores == 2  # the partial recovery counted as one
    restorer.close()


@pytest.mark.timeout(180)
def test_partial_recovery_reloads_only_the_failed_rank(tmp_path):
    run_ranks(_worker, world_size=2, timeout=150, args=(str(tmp_path),))


# ---- recover() refuses failed ranks that leave nothing to recover from (one process)

@pytest.mark.parametrize("failed, why", [
    ([], "give the ranks that failed"),
    ([1], "give the ranks that failed"),  # outside a world of one rank
    ([-1], "give the ranks that failed"),
    ([0], "every rank failed"),
])
def test_recover_refuses_failed_ranks_that_leave_nothing_to_recover_from(group, tmp_path, failed, why):
    from _toy import build_dmp

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.errors import ConfigError
    from examples.toy import TableSpec

    dmp, opt = build_dmp([TableSpec("t0", 40, 4, "table_wise", "ebc")])
    with Checkpointer(dmp, load_config({"root": str(tmp_path)}), dense_optimizer=opt) as ck:
        ck.save(1).wait()
        with pytest.raises(ConfigError, match=why):
            ck.recover(failed)
        assert ck.list()[-1].step == 1  # nothing was touched
