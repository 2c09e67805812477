"""Managed-collision (sort-zch, ``MCHManagedCollisionModule``) models as fixtures: a tiny model around a
ManagedCollisionEmbeddingBagCollection (pooled) or ManagedCollisionEmbeddingCollection (sequence),
sharded row_wise on CPU over gloo, and skewed batches that make the MC modules evict every interval.

What works on CPU (torchrec 1.8, fbgemm-gpu-cpu 1.8), checked with plain DistributedModelParallel on 1
and 2 ranks:

* Sharding: only row_wise (the MC sharder allows nothing else), compute kernel ``fused``, from a
  hand-built plan.
* Fused optimizers: EXACT_SGD and EXACT_ADAGRAD. EXACT_ROWWISE_ADAGRAD fails at the first eviction:
  ``_evict`` calls ``tbe.reset_embedding_weight_momentum``, and ``fbgemm::reset_weight_momentum`` has
  no CPU kernel.
* A table looked up by two features works (``big`` below), and so does a feature that two tables
  share (``shared_feature=True``: ``f_b`` also looks up ``small``; outputs are then keyed
  ``"f_b@big"``/``"f_b@small"`` in the EC). The sharded collection's "Shared feature is not supported"
  assertion compares counts taken from the same grouped configs, so for row_wise it does not fire.
* Per-id weights (``weighted=True``, EBC only) reach the pooling only with ``need_preprocess=False`` on
  the ManagedCollisionCollection: its default preprocess path rebuilds the KJT without 1-D weights, so a
  weighted EBC would silently pool with weight 1.
* Mixed dims only for ``"ebc"``: an EmbeddingCollection needs one dim for all its tables.

A model's routing depends on the world size: the input dist sends raw id ``x < input_hash_size`` to rank
``x // ceil(input_hash_size / world_size)`` (ids past that go by remainder), and each rank's MC module owns its own slots (misses land
in the last slot of each rank's shard). A 1-rank and a 2-rank model start with equal weights and see the
same global batches, but they do not train to the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel

GLOBAL_BATCH = 8
MAX_POOLING = 4
LR = 0.05

# Fixture name -> the fused (in-backward) table optimizer.
OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,  # fails on CPU at the first eviction
}
POLICIES = ("lfu", "lru", "distance_lfu")


@dataclass(frozen=True)
class MCTable:
    """One managed-collision table.

    Attributes:
        name: table name.
        rows: zch_size (= num_embeddings): how many raw ids the table holds at once.
        dim: embedding_dim.
        features: the features that look it up.
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]

    def config(self, kind: str) -> EmbeddingBagConfig | EmbeddingConfig:
        cls = EmbeddingConfig if kind == "ec" else EmbeddingBagConfig
        return cls(name=self.name, num_embeddings=self.rows, embedding_dim=self.dim, feature_names=list(self.features))


def mc_tables(kind: str, zch_rows: tuple[int, int] = (48, 32), dim: int = 8,
              shared_feature: bool = False) -> tuple[MCTable, ...]:
    """The two tables of a fixture: ``big`` (``zch_rows[0]`` rows, looked up by ``f_a`` and ``f_b``) and
    ``small`` (``zch_rows[1]`` rows, ``f_c``, and ``f_b`` too if ``shared_feature``). For ``"ebc"``
    ``small`` has half the dim (mixed dims); an EmbeddingCollection needs one dim, so for ``"ec"`` both
    have ``dim``."""
    small_dim = dim if kind == "ec" else max(4, dim // 2)
    small_features = ("f_b", "f_c") if shared_feature else ("f_c",)
    return (MCTable("big", zch_rows[0], dim, ("f_a", "f_b")), MCTable("small", zch_rows[1], small_dim, small_features))


def features_of(tables: tuple[MCTable, ...]) -> list[str]:
    """The distinct features of ``tables`` (the batch KJT's keys), in order of first use."""
    return list(dict.fromkeys(f for t in tables for f in t.features))


def eviction_policy(policy: str):
    """``"lfu"``, ``"lru"`` or ``"distance_lfu"`` as a torchrec MCHEvictionPolicy."""
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy

    policies = {"lfu": LFU_EvictionPolicy, "lru": LRU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}
    return policies[policy]()


class MCSparseModel(torch.nn.Module):
    """An MC-EBC or MC-EC (attribute ``mc_ebc`` or ``mc_ec``) and a Linear (``dense``) over each
    sample's pooled (EBC) or summed (EC) embeddings, concatenated over features; the forward returns the
    loss, the mean square of the Linear's output (no labels). One MCHManagedCollisionModule per table,
    each with its own instance of the eviction policy."""

    def __init__(self, kind: str, tables: tuple[MCTable, ...], *, policy: str, eviction_interval: int,
                 input_hash_size: int, weighted: bool = False) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
        from torchrec.modules.mc_embedding_modules import (
            ManagedCollisionEmbeddingBagCollection,
            ManagedCollisionEmbeddingCollection,
        )
        from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

        cpu = torch.device("cpu")
        configs = [t.config(kind) for t in tables]
        mcc = ManagedCollisionCollection(
            managed_collision_modules={
                t.name: MCHManagedCollisionModule(
                    zch_size=t.rows, device=cpu, eviction_policy=eviction_policy(policy),
                    eviction_interval=eviction_interval, input_hash_size=input_hash_size, name=t.name,
                )
                for t in tables
            },
            embedding_configs=configs,
            need_preprocess=not weighted,
        )
        self.kind = kind
        if kind == "ebc":
            ebc = EmbeddingBagCollection(configs, is_weighted=weighted, device=cpu)
            self.mc_ebc = ManagedCollisionEmbeddingBagCollection(ebc, mcc)
        elif kind == "ec":
            self.mc_ec = ManagedCollisionEmbeddingCollection(EmbeddingCollection(configs, device=cpu), mcc)
        else:
            raise ValueError(kind)
        self.dense = torch.nn.Linear(sum(t.dim * len(t.features) for t in tables), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        if self.kind == "ebc":
            pooled, _ = self.mc_ebc(kjt)
            x = pooled.values()
        else:
            seqs, _ = self.mc_ec(kjt)
            # Keyed by embedding name: the feature name, or "feature@table" for a feature two tables share.
            x = torch.cat([_sum_per_sample(seqs[name], kjt.stride()) for name in sorted(seqs.keys())], dim=1)
        return self.dense(x).square().mean()


def _sum_per_sample(jt, batch: int) -> torch.Tensor:
    """A sequence feature's embeddings summed per sample: ``[batch, dim]``."""
    values = jt.values()
    sample = torch.repeat_interleave(torch.arange(batch), jt.lengths())
    return torch.zeros(batch, values.shape[1], dtype=values.dtype).index_add(0, sample, values)


@dataclass
class MCModel:
    """A sharded MC fixture model.

    Attributes:
        dmp: the sharded model (``dmp_cls`` instance); ``dmp(kjt)`` returns the loss.
        kind: ``"ebc"`` or ``"ec"``.
        mc_fqn: the MC module's name in the unwrapped model (``"mc_ebc"`` / ``"mc_ec"``); its sharded
            form is ``dmp.module.<mc_fqn>``, and its state_dict keys start ``"<mc_fqn>."``.
        tables: the tables.
        dense_optimizer: SGD (lr ``LR``) over the parameters the fused optimizers do not update.
        policy / optimizer / eviction_interval / input_hash_size: as built.
    """

    dmp: torch.nn.Module
    kind: str
    mc_fqn: str
    tables: tuple[MCTable, ...]
    dense_optimizer: torch.optim.Optimizer
    policy: str
    optimizer: str
    eviction_interval: int
    input_hash_size: int
    features: list[str] = field(default_factory=list)

    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def fused_optimizer(self):
        """The DMP's KeyedOptimizer over the fused tables (updates happen in backward)."""
        return self.dmp.fused_optimizer

    @property
    def sharded_mc(self) -> torch.nn.Module:
        """The sharded ManagedCollision(EmbeddingBag|Embedding)Collection."""
        return getattr(self.dmp.module, self.mc_fqn)

    def mc_modules(self) -> dict[str, torch.nn.Module]:
        """This rank's MCHManagedCollisionModule per table (each owns this rank's row range)."""
        return dict(self.sharded_mc._managed_collision_collection._managed_collision_modules.items())


def _sharders(kind: str, optimizer: str) -> list:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    fused = {"optimizer": OPTIMIZERS[optimizer], "learning_rate": LR}
    if kind == "ebc":
        return [ManagedCollisionEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params=fused))]
    return [ManagedCollisionEmbeddingCollectionSharder(EmbeddingCollectionSharder(fused_params=fused))]


def _plan(module: MCSparseModel, mc_fqn: str, sharder, world_size: int, device_type: str):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    sub = getattr(module, mc_fqn)
    configs = sub._managed_collision_collection.embedding_configs()
    module_plan = construct_module_sharding_plan(
        sub, {c.name: row_wise(compute_kernel="fused") for c in configs}, sharder=sharder,
        local_size=world_size, world_size=world_size, device_type=device_type,
    )
    return ShardingPlan({mc_fqn: module_plan})


def copy_initial_weights(dmp: torch.nn.Module, unsharded: dict[str, torch.Tensor]) -> None:
    """Overwrites this rank's table shards with their slices of ``unsharded`` (an unsharded model's
    state_dict). DMP does not copy a CPU model's table weights into the fused TBEs (it does so only for
    modules on an accelerator), so the sharded tables would otherwise start from FBGEMM's own draw."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if not isinstance(value, ShardedTensor) or not key.endswith(".weight"):
                continue
            full = unsharded[key.removeprefix("module.")]
            for shard in value.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r:r + h, c:c + w])


def build_mc_model(kind: str, world_size: int, *, policy: str = "lfu", optimizer: str = "sgd",
                   zch_rows: tuple[int, int] = (48, 32), dim: int = 8, eviction_interval: int = 2,
                   input_hash_size: int = 4000, seed: int = 0, weighted: bool = False,
                   shared_feature: bool = False, dmp_cls: type = DistributedModelParallel,
                   device: torch.device = torch.device("cpu"), copy_initial: bool = True,
                   **dmp_kwargs: object) -> MCModel:
    """An ``MCSparseModel`` sharded row_wise over the default group by ``dmp_cls`` (CheckNRunDMP has
    DistributedModelParallel's signature), with ``optimizer`` (a key of ``OPTIMIZERS``) fused into the
    tables and ``policy`` (one of ``POLICIES``) evicting every ``eviction_interval`` steps.

    The unsharded model is built on CPU under ``torch.manual_seed(seed)`` and its table weights are
    copied into the shards, so every world size starts from the same weights (the MC buffers start
    empty everywhere). ``world_size`` must equal the default group's size. ``weighted`` (EBC only) makes
    the EBC take per-id weights (feed it ``mc_batches(..., weighted=True)``); ``shared_feature``: see
    ``mc_tables``. ``copy_initial=False`` leaves the shards as TorchRec fills them; ``dmp_kwargs`` go to
    ``dmp_cls``.
    """
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    assert world_size == dist.get_world_size(), (world_size, dist.get_world_size())
    tables = mc_tables(kind, zch_rows, dim, shared_feature)
    torch.manual_seed(seed)
    module = MCSparseModel(kind, tables, policy=policy, eviction_interval=eviction_interval,
                           input_hash_size=input_hash_size, weighted=weighted)
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    mc_fqn = "mc_ebc" if kind == "ebc" else "mc_ec"
    sharders = _sharders(kind, optimizer)
    dmp = dmp_cls(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                  plan=_plan(module, mc_fqn, sharders[0], world_size, device.type), sharders=sharders, **dmp_kwargs)
    if copy_initial:
        copy_initial_weights(dmp, initial)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters()) if p.requires_grad]
    return MCModel(dmp=dmp, kind=kind, mc_fqn=mc_fqn, tables=tables, dense_optimizer=torch.optim.SGD(dense, lr=LR),
                   policy=policy, optimizer=optimizer, eviction_interval=eviction_interval,
                   input_hash_size=input_hash_size, features=features_of(tables))


def mc_batches(n: int, world_size: int, rank: int, *, seed: int, features: list[str] | None = None,
               input_hash_size: int = 4000, global_batch: int = GLOBAL_BATCH, alpha: float = 1.1,
               distinct: int = 400, drift: int = 5, weighted: bool = False) -> list[KeyedJaggedTensor]:
    """``n`` batches for ``rank``: its slice (``global_batch // world_size`` samples) of global batches
    that depend only on ``seed``, so every world size sees the same data; batch ``i`` is the same for
    every ``n > i``. ``features`` are the KJT keys (``MCModel.features``; the default is the fixture's).

    Raw ids are Zipf(``alpha``) over ``distinct`` ids (far more than a table's slots, so the MC modules
    evict every interval), scattered over ``[0, input_hash_size)`` by a fixed permutation so the
    frequent ids fall on every rank's id range. Each sample has 1..``MAX_POOLING`` ids per feature.
    The popular ids move by ``drift`` Zipf ranks a step, so newly hot ids also displace resident ones
    under LFU (whose residents keep their counts; without drift LFU mostly fills empty slots).
    """
    features = features or ["f_a", "f_b", "f_c"]
    assert global_batch % world_size == 0, (global_batch, world_size)
    gen = torch.Generator().manual_seed(seed)
    raw_ids = torch.randperm(input_hash_size, generator=gen)[:distinct]
    zipf = torch.arange(1, distinct + 1, dtype=torch.float64).pow(-alpha)
    per_rank = global_batch // world_size
    out = []
    for step in range(n):
        lengths = torch.randint(1, MAX_POOLING + 1, (len(features), global_batch), generator=gen)
        popularity = torch.multinomial(zipf, int(lengths.sum()), replacement=True, generator=gen)
        values = raw_ids[(popularity + step * drift) % distinct]
        per_feature = values.split(lengths.sum(dim=1).tolist())
        weights = torch.rand(values.shape, generator=gen) if weighted else torch.ones(values.shape)
        per_weight = weights.split(lengths.sum(dim=1).tolist())
        mine_v, mine_l, mine_w = [], [], []
        for f_lengths, f_values, f_weights in zip(lengths, per_feature, per_weight):
            start = int(f_lengths[:rank * per_rank].sum())
            stop = start + int(f_lengths[rank * per_rank:(rank + 1) * per_rank].sum())
            mine_v.append(f_values[start:stop])
            mine_w.append(f_weights[start:stop])
            mine_l.append(f_lengths[rank * per_rank:(rank + 1) * per_rank])
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=list(features), values=torch.cat(mine_v),
                                                       lengths=torch.cat(mine_l),
                                                       weights=torch.cat(mine_w) if weighted else None))
    return out


def train_step(model: MCModel, batch: KeyedJaggedTensor) -> torch.Tensor:
    """Forward, backward (the fused table optimizers step inside it) and a dense SGD step; the loss."""
    loss = model.dmp(batch)
    loss.backward()
    model.dense_optimizer.step()
    model.dense_optimizer.zero_grad()
    return loss.detach()
