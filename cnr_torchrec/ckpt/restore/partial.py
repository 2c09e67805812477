"""CPR partial recovery: only the failed ranks reload; the state every rank holds alike comes from a survivor.

After a failure, the failed ranks reload their own shards from the checkpoint while the
survivors keep their live rows. What DDP replicates (dense parameters and buffers,
data_parallel tables, the dense optimizer's state, the TBE step counters) is not taken
from the checkpoint but broadcast from a survivor, so that the replicas agree again and
the dense part loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cnr_torchrec.ckpt._collective import Failure, Ranks
from cnr_torchrec.ckpt.format.bytes.chunks import IOPool
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import load_manifest
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.job_state import JobState
from cnr_torchrec.ckpt.live.dense_params import dense_named_state
from cnr_torchrec.ckpt.restore.chain import RestoreOptions, restore_chain, restore_dense_optimizer
from cnr_torchrec.ckpt.restore.restorer import Restorer
from cnr_torchrec.ckpt.restore.threads import decode_threads
from cnr_torchrec.errors import CheckpointError, CheckpointNotFoundError, ConfigError

__all__ = ["Recovery", "RecoveryInfo", "replicated_tensors", "sync_from_survivor"]

log = logging.getLogger(__name__)


def replicated_tensors(job: JobState) -> list[tuple[str, Any]]:
    """(name, tensor) of everything DDP keeps identical on every rank of ``job``, in an order all ranks share.

    (The TBE step counters are replicated too, but each rank holds its own set of TBEs:
    :func:`sync_from_survivor` copies them separately.)
    """
    tracker, dense_optimizer = job.tracker, job.dense_optimizer
    out: list[tuple[str, Any]] = sorted(dense_named_state(job.model, tracker.module_fqns()).items())
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


def sync_from_survivor(job: JobState, src: int) -> int:
    """Broadcasts the replicated state of ``job`` from rank ``src`` to every rank. Returns the bytes sent.

    Raises:
        CheckpointError: the ranks do not hold the same replicated state (names, shapes,
            dtypes), e.g. a failed rank's dense optimizer has no state yet while the
            survivor's has: restore the failed rank from the checkpoint first.
    """
    tensors = replicated_tensors(job)
    tracker = job.tracker
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


@dataclass(frozen=True)
class RecoveryInfo:
    """What a partial recovery did: the checkpoint, the ranks, and what moved."""

    ckpt_id: int
    step: int
    failed_ranks: tuple[int, ...]
    bytes_read: int  # from storage, by all failed ranks together
    bytes_broadcast: int  # replicated state sent from the survivor


class Recovery:
    """CPR partial recoveries for one :class:`~cnr_torchrec.ckpt.Checkpointer`.

    Only the failed ranks reload, their embedding shards with their optimizer state, their
    ``extra_state`` (reader position) and, under ``restore_rng``, RNG, from the newest complete
    checkpoint (or the newest of a step); the survivors read nothing and keep their training state. What DDP replicates
    (dense parameters and buffers, data_parallel tables, the dense optimizer, the TBE step) is
    then broadcast from the lowest surviving rank. The updates the failed ranks' rows received
    since the checkpoint are lost: that is the trade CPR makes for not rolling every rank back
    (``failure.target_lost_fraction``).

    Call order, on every rank at once (the replaced ranks as fresh processes): :meth:`check`
    the failed ranks, settle what is in flight, then :meth:`run`.
    """

    def __init__(self, restorer: Restorer, *, storage: Storage, io: IOPool, ranks: Ranks) -> None:
        self._restorer, self._storage, self._io, self._ranks = restorer, storage, io, ranks
        self.job = restorer.job  # the job's state its restores write

    def check(self, failed_ranks: Iterable[int]) -> list[int]:
        """The failed ranks, sorted.

        Raises:
            ConfigError: none given, a rank outside the job, or every rank (nothing survives: use
                ``Checkpointer.restore``).
        """
        world = self._ranks.world_size
        failed = sorted({int(r) for r in failed_ranks})
        if not failed or failed[0] < 0 or failed[-1] >= world:
            raise ConfigError(f"recover(failed_ranks={failed}): give the ranks that failed, each in [0, {world})")
        if len(failed) == world:
            raise ConfigError("recover(): every rank failed, so no live state survives; call restore() instead")
        opt = self.job.dense_optimizer
        if opt is not None and not (hasattr(opt, "param_groups") and hasattr(opt, "state")):
            raise ConfigError(
                f"recover(): the dense optimizer (a {type(opt).__name__}) has no param_groups/state, which partial "
                "recovery copies from a surviving rank tensor by tensor; call restore() instead, or use a "
                "torch.optim or TorchRec KeyedOptimizer")
        return failed

    def run(self, failed: list[int], step: int | None) -> tuple[RecoveryInfo, list[Manifest]]:
        """Recovers the ``failed`` ranks (from :meth:`check`). Collective. Returns what it did and the chain.

        Raises:
            CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError, StorageError:
                as for restore, on every rank alike, naming the rank where it happened (rank 0 for
                the choice of checkpoint, a failed rank for its reads).
        """
        rank, world = self._ranks.rank, self._ranks.world_size
        survivor = min(r for r in range(world) if r not in failed)
        # Rank 0 resolves; the survivors read nothing else, and the failed ranks load the pick's manifests below.
        pick, chain = self._restorer.agree_on_pick(step, {}, local=False)
        if not pick.chain:
            raise CheckpointNotFoundError(self._restorer.not_found(step))
        stats: dict[str, float] = {}
        failure, cause = None, None
        try:
            chain = chain or [load_manifest(self._storage, i) for i in pick.chain]
            if rank in failed:
                self._reload(chain, stats)
        except Exception as e:  # the other ranks must hear of it before any broadcast
            failure, cause = Failure.of(e, rank, f"recovering from checkpoint {pick.chain[-1]}"), e
        self._ranks.raise_any(failure, cause)
        assert chain is not None  # loaded above, or raise_any raised on every rank
        sent = sync_from_survivor(self.job, src=survivor)
        if rank in failed:
            self.job.tracker.reset(baseline=True)
        read = torch.tensor([stats.get("bytes_read", 0)], dtype=torch.int64)
        if self._ranks.distributed:
            dist.all_reduce(read)
        m = chain[-1]
        info = RecoveryInfo(ckpt_id=m.id, step=m.step, failed_ranks=tuple(failed),
                            bytes_read=int(read), bytes_broadcast=sent)
        log.info("partial recovery of ranks %s from checkpoint %d (step %d): %d bytes read, %d bytes of replicated "
                 "state from rank %d", failed, m.id, m.step, info.bytes_read, sent, survivor)
        return info, chain

    def _reload(self, chain: list[Manifest], stats: dict[str, float]) -> None:
        """A failed rank's own shards, per-rank state and dense optimizer layout, from ``chain``."""
        config = self._restorer.config
        options = RestoreOptions(replicated=False, rng=config.restore_rng, pool=self._io,
                                 threads=decode_threads(config.restore_threads), stats=stats)
        restore_chain(chain, self.job, storage=self._storage, rank=self._ranks.rank,
                      world_size=self._ranks.world_size, options=options)
        if self.job.dense_optimizer is not None:  # its layout; the survivor's values follow
            restore_dense_optimizer(chain[-1], self._storage, self.job.model, self.job.dense_optimizer, stats)
