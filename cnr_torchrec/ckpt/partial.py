"""CPR partial recovery: the state every rank holds alike, copied from a surviving rank.

After a failure, the failed ranks reload their own shards from the checkpoint while the
survivors keep their live rows. What DDP replicates (dense parameters and buffers,
data_parallel tables, the dense optimizer's state, the TBE step counters) is not taken
from the checkpoint but broadcast from a survivor, so that the replicas agree again and
the dense part loses nothing.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cnr_torchrec.ckpt.save import dense_named_state
from cnr_torchrec.errors import CheckpointError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["replicated_tensors", "sync_from_survivor"]


def replicated_tensors(model: nn.Module, tracker: DirtyRowTracker, dense_optimizer: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of everything DDP keeps identical on every rank, in an order all ranks share.

    (The TBE step counters are replicated too, but each rank holds its own set of TBEs:
    :func:`sync_from_survivor` copies them separately.)
    """
    out: list[tuple[str, Any]] = sorted(dense_named_state(model, tracker).items())
    for table in tracker.tables():
        if tracker.is_data_parallel(table):
            for i, (kernel, shard) in enumerate(tracker.shards(table)):
                out.append((f"{table}/{i}", kernel.tbe.split_embedding_weights()[shard.local_index]))
    if dense_optimizer is not None:
        for p_index, group_state in enumerate(_optimizer_states(dense_optimizer)):
            for key in sorted(group_state):
                value = group_state[key]
                if isinstance(value, torch.Tensor):
                    out.append((f"dense_optimizer/{p_index}/{key}", value))
    return out


def _optimizer_states(optimizer: Any) -> list[dict[str, Any]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [optimizer.state.get(p, {}) for p in params]


def sync_from_survivor(model: nn.Module, tracker: DirtyRowTracker, dense_optimizer: Any, src: int) -> int:
    """Broadcasts the replicated state from rank ``src`` to every rank. Returns the bytes sent.

    Raises:
        CheckpointError: the ranks do not hold the same replicated state (names, shapes,
            dtypes), e.g. a failed rank's dense optimizer has no state yet while the
            survivor's has: restore the failed rank from the checkpoint first.
    """
    tensors = replicated_tensors(model, tracker, dense_optimizer)
    signature = json.dumps([(name, list(t.shape), str(t.dtype)) for name, t in tensors]).encode()
    digest = torch.tensor([int.from_bytes(hashlib.sha256(signature).digest()[:7], "little")], dtype=torch.int64)
    everyone = [torch.zeros_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, digest)
    bad = [r for r, d in enumerate(everyone) if int(d) != int(everyone[src])]
    if bad:
        raise CheckpointError(
            f"partial recovery: ranks {bad} hold other replicated state (names, shapes or dtypes of dense "
            f"parameters, data_parallel tables or dense optimizer state) than survivor rank {src}; this rank has "
            f"{len(tensors)} such tensors. Every rank must run the same model, and a replaced rank must restore its "
            "dense optimizer from the checkpoint before the survivor's state is copied over it"
        )
    sent = 0
    with torch.no_grad():
        for _, t in tensors:
            dist.broadcast(t.data if isinstance(t, nn.Parameter) else t, src=src)
            sent += t.numel() * t.element_size()
        # The TBE step counters: ranks hold different TBEs, all stepped alike; take the survivor's count.
        iters = [it for tbe in tracker.tbes() if isinstance(it := getattr(tbe, "iter", None), torch.Tensor)]
        step = torch.tensor([max((int(it.max()) for it in iters if it.numel()), default=0)], dtype=torch.int64)
        dist.broadcast(step, src=src)
        for it in iters:
            it.fill_(int(step))
    return sent
