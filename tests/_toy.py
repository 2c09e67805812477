"""The toy model the checkpoint tests share: build it sharded, train it, and copy its state."""

from __future__ import annotations

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType


def build_dmp(specs, *, seed=0, dense_optimizer=torch.optim.Adam, fused=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
              **tracker_kwargs):
    """``ToyModel(specs)`` in a CheckNRunDMP over the default group (``fused`` in the tables, rowwise Adagrad
    unless told), and an optimizer (lr 0.01) over what DDP replicates: the dense parameters and the
    data_parallel tables."""
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from examples.toy import ToyModel, build_plan, sharders_for

    torch.manual_seed(seed)
    model = ToyModel(specs)
    sharders = sharders_for(fused, lr=0.05)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=build_plan(model, sharders, dist.get_world_size()), sharders=sharders, **tracker_kwargs)
    replicated = [s.name for s in specs if s.sharding == "data_parallel"]
    dense = [p for n, p in dmp.named_parameters() if n.startswith("dense") or any(f".{t}." in n for t in replicated)]
    return dmp, dense_optimizer(dense, lr=0.01)


def train(dmp, specs, opt, steps, gen):
    from examples.toy import zipf_batch

    for _ in range(steps):
        loss = dmp(zipf_batch(specs, batch_size=8, pooling=3, generator=gen, alpha=1.05))
        loss.backward()
        opt.step()
        opt.zero_grad()


def local_state(dmp):
    """Copies of this rank's shards (weights and fused-optimizer states) and dense parameters."""
    out = {}
    tracker = dmp.dirty_tracker
    for t in tracker.tables():
        for i, (k, s) in enumerate(tracker.shards(t)):
            out[(t, i, "w")] = k.tbe.split_embedding_weights()[s.local_index].detach().clone()
            if hasattr(k.tbe, "split_optimizer_states"):
                for j, st in enumerate(k.tbe.split_optimizer_states()[s.local_index]):
                    out[(t, i, j)] = st.detach().clone()
    for n, p in dmp.named_parameters():
        if n.startswith("dense"):
            out[n] = p.detach().clone()
    return out


class Reader:
    """Per-rank state a job keeps beside the model (a data reader's position), for ``extra_state``."""

    def __init__(self) -> None:
        self.pos = torch.zeros(1, dtype=torch.int64)

    def state_dict(self):
        return {"pos": self.pos.clone()}

    def load_state_dict(self, sd):
        self.pos.copy_(sd["pos"])
