"""A small sharded recommendation model with hand-built plans, for demos, tests and benchmarks.

The planner drops row_wise on CPU, so plans are built table by table with
``construct_module_sharding_plan``; every sharded table gets the fused kernel.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["TableSpec", "ToyModel", "SHARDING_TYPES", "build_plan", "sharders_for", "zipf_batch"]

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


@dataclass(frozen=True)
class TableSpec:
    """One embedding table of the toy model.

    Attributes:
        name: table name; its single feature is ``f"{name}_f"``.
        rows: num_embeddings.
        dim: embedding_dim (column_wise needs a multiple of 2·world_size).
        sharding: one of :data:`SHARDING_TYPES`.
        kind: ``"ebc"`` (pooled) or ``"ec"`` (sequence).
    """

    name: str
    rows: int
    dim: int
    sharding: str
    kind: str = "ebc"

    @property
    def feature(self) -> str:
        return f"{self.name}_f"


class ToyModel(nn.Module):
    """Pooled (EBC) and sequence (EC) tables plus a dense tower; ``forward(kjt)`` returns a scalar loss.

    Data-parallel sequence tables get their own EmbeddingCollection, because on CPU
    an EC fails when data_parallel is mixed with other sharding types.
    """

    def __init__(self, specs: list[TableSpec], device: torch.device | str = "meta") -> None:
        super().__init__()
        self.specs = list(specs)
        groups = {"ebc": [], "ec": [], "ec_dp": []}
        for s in specs:
            groups["ec_dp" if s.kind == "ec" and s.sharding == "data_parallel" else s.kind].append(s)
        self.ebc = (
            EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=s.name, embedding_dim=s.dim, num_embeddings=s.rows,
                                           feature_names=[s.feature]) for s in groups["ebc"]],
                device=torch.device(device),
            )
            if groups["ebc"] else None
        )
        for attr in ("ec", "ec_dp"):
            setattr(self, attr, EmbeddingCollection(
                tables=[EmbeddingConfig(name=s.name, embedding_dim=s.dim, num_embeddings=s.rows,
                                        feature_names=[s.feature]) for s in groups[attr]],
                device=torch.device(device),
            ) if groups[attr] else None)
        self._groups = {k: [s.feature for s in v] for k, v in groups.items() if v}
        width = sum(s.dim for s in groups["ebc"]) + sum(s.dim for s in groups["ec"] + groups["ec_dp"])
        self.dense = nn.Linear(width, 1)
        self.register_buffer("_unused", torch.zeros(1), persistent=False)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        # Each collection gets only its own features.
        jts = kjt.to_dict() if len(self._groups) > 1 else None
        parts = []
        for attr in ("ebc", "ec", "ec_dp"):
            module = getattr(self, attr)
            if module is None:
                continue
            sub = kjt if jts is None else KeyedJaggedTensor.from_jt_dict({k: jts[k] for k in self._groups[attr]})
            if attr == "ebc":
                parts.append(module(sub).values())
                continue
            for jt in module(sub).values():
                # Sum each sequence into one vector per sample.
                lengths = jt.lengths()
                seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
                pooled = torch.zeros(lengths.numel(), jt.values().shape[1]).index_add_(0, seg, jt.values())
                parts.append(pooled)
        logits = self.dense(torch.cat(parts, dim=1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones_like(logits) * 0.3)


def _generator(spec: TableSpec, world_size: int, index: int):
    if spec.sharding == "table_wise":
        return table_wise(rank=index % world_size, compute_kernel="fused")
    if spec.sharding == "row_wise":
        return row_wise(compute_kernel="fused")
    if spec.sharding == "column_wise":
        return column_wise(ranks=list(range(world_size)) * 2, compute_kernel="fused")
    if spec.sharding == "table_row_wise":
        return table_row_wise(host_index=0)
    if spec.sharding == "data_parallel":
        return data_parallel()
    raise ValueError(f"unknown sharding type {spec.sharding!r}; choose one of {SHARDING_TYPES}")


def sharders_for(optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr: float = 0.05) -> list:
    """EBC and EC sharders whose sharded tables use a fused FBGEMM optimizer."""
    fused = {"optimizer": optimizer, "learning_rate": lr}
    return [EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused)]


def build_plan(model: ToyModel, sharders: list, world_size: int, device_type: str = "cpu") -> ShardingPlan:
    """A sharding plan that honours each table's ``sharding`` field."""
    by_name = {s.name: s for s in model.specs}
    plan = {}
    for attr, sharder in (("ebc", sharders[0]), ("ec", sharders[1]), ("ec_dp", sharders[1])):
        module = getattr(model, attr)
        if module is None:
            continue
        names = [c.name for c in (module.embedding_bag_configs() if attr == "ebc" else module.embedding_configs())]
        # Table-wise tables go round-robin among themselves, so that alternating kinds do not pile on one rank.
        placed: dict[str, int] = {}
        gens = {}
        for n in names:
            kind = by_name[n].sharding
            gens[n] = _generator(by_name[n], world_size, placed.get(kind, 0))
            placed[kind] = placed.get(kind, 0) + 1
        module_plan = construct_module_sharding_plan(
            module, per_param_sharding=gens, local_size=world_size, world_size=world_size,
            device_type=device_type, sharder=sharder,
        )
        for n in names:
            if by_name[n].sharding == "table_row_wise":  # table_row_wise() takes no compute_kernel
                module_plan[n].compute_kernel = "fused"
        plan[attr] = module_plan
    return ShardingPlan(plan)


@functools.lru_cache(maxsize=64)
def _zipf_table(name: str, rows: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return probs, perm


def zipf_batch(
    specs: list[TableSpec], batch_size: int, pooling: int, generator: torch.Generator, alpha: float = 1.05
) -> KeyedJaggedTensor:
    """A KJT with ``pooling`` Zipf-skewed ids per sample for every table's feature.

    Ids are ranked by a fixed random permutation per table, so the hot rows are
    scattered across row shards rather than all on the first.
    """
    values, lengths = [], []
    for s in specs:
        probs, perm = _zipf_table(s.name, s.rows, alpha)
        draws = torch.multinomial(probs, batch_size * pooling, replacement=True, generator=generator)
        values.append(perm[draws])
        lengths.append(torch.full((batch_size,), pooling, dtype=torch.int64))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[s.feature for s in specs], values=torch.cat(values), lengths=torch.cat(lengths)
    )
