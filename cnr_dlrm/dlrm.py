"""The training job's model: torchrec's DLRM over the 26 Criteo tables, and a hand-built sharding plan.

torchrec's planner drops row_wise on CPU, so the plan is built table by table: tables of
at least ``row_wise_min_rows`` rows are split by rows over every rank, the others are
placed whole (table_wise) on the rank that holds the fewest bytes so far, largest first.
Every table uses the fused kernel, so its optimizer runs inside the TBE backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain

from cnr_torchrec.errors import ConfigError

from cnr_dlrm.data import NUM_DENSE

__all__ = ["EBC_FQN", "EMBEDDING_OPTIMIZERS", "ModelConfig", "build_model", "build_plan", "dense_parameters",
           "make_sharder", "plan_assignment", "table_features", "table_name"]

log = logging.getLogger(__name__)

# Where the EmbeddingBagCollection sits inside DLRMTrain (the plan's module path).
EBC_FQN = "model.sparse_arch.embedding_bag_collection"

EMBEDDING_OPTIMIZERS: dict[str, EmbOptimType] = {
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "sgd": EmbOptimType.EXACT_SGD,
}


@dataclass(frozen=True)
class ModelConfig:
    """The ``model:`` section of a job config.

    Attributes:
        embedding_dim: width of every embedding table (DLRM needs one width for all).
        dense_arch_layer_sizes: the bottom MLP over the 13 dense features; the last size
            must equal ``embedding_dim``.
        over_arch_layer_sizes: the top MLP over the feature interactions; the last size must be 1.
        row_wise_min_rows: tables with at least this many rows are sharded row_wise, the others table_wise.
        init_seed: seed of the initial weights.
        shared_tables: groups of features that look up one table between them, e.g.
            ``[[cat_0, cat_1]]``. A group's table is named after its first feature and has as
            many rows as the largest of its features' cardinalities; every other feature keeps
            a table of its own.
    """

    embedding_dim: int = 16
    dense_arch_layer_sizes: tuple[int, ...] = (64, 16)
    over_arch_layer_sizes: tuple[int, ...] = (128, 64, 1)
    row_wise_min_rows: int = 10_000
    init_seed: int = 0
    shared_tables: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.embedding_dim < 1:
            raise ConfigError(f"embedding_dim: must be at least 1, got {self.embedding_dim}")
        for key in ("dense_arch_layer_sizes", "over_arch_layer_sizes"):
            sizes = getattr(self, key)
            if not sizes or any(s < 1 for s in sizes):
                raise ConfigError(f"{key}: must be a non-empty list of positive layer sizes, got {list(sizes)}")
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ConfigError(
                f"dense_arch_layer_sizes: the last size ({self.dense_arch_layer_sizes[-1]}) must equal "
                f"embedding_dim ({self.embedding_dim}); DLRM interacts the dense output with the embeddings"
            )
        if self.over_arch_layer_sizes[-1] != 1:
            raise ConfigError(
                "over_arch_layer_sizes: the last size must be 1 (the click logit), "
                f"got {self.over_arch_layer_sizes[-1]}"
            )
        if self.row_wise_min_rows < 1:
            raise ConfigError(f"row_wise_min_rows: must be at least 1, got {self.row_wise_min_rows}")
        seen: set[str] = set()
        for group in self.shared_tables:
            if len(group) < 2:
                raise ConfigError(f"shared_tables: a group needs at least two features, got {list(group)}")
            twice = sorted(seen.intersection(group)) or sorted(f for f in group if group.count(f) > 1)
            if twice:
                raise ConfigError(f"shared_tables: feature {twice[0]!r} is in more than one place; a feature "
                                  "looks up exactly one table")
            seen.update(group)


def table_features(config: ModelConfig, table_rows: list[int], features: list[str]) -> dict[str, tuple[int, list[str]]]:
    """Each table of the model: its rows and the features that look it up, in feature order.

    Raises:
        ConfigError: ``shared_tables`` names a feature the data does not have.
    """
    rows_of = dict(zip(features, table_rows))
    group_of: dict[str, tuple[str, ...]] = {}
    for group in config.shared_tables:
        unknown = [f for f in group if f not in rows_of]
        if unknown:
            raise ConfigError(f"model.shared_tables: unknown feature {unknown[0]!r}; the features are "
                              f"{features[0]} .. {features[-1]}")
        for f in group:
            group_of[f] = group
    tables: dict[str, tuple[int, list[str]]] = {}
    for f in features:
        group = group_of.get(f, (f,))
        name = table_name(group[0])
        if name not in tables:
            tables[name] = (max(rows_of[g] for g in group), [g for g in features if g in group])
    return tables


def table_name(feature: str) -> str:
    """The table behind a feature: ``cat_3`` -> ``t_cat_3``."""
    return f"t_{feature}"


def build_model(config: ModelConfig, table_rows: list[int], features: list[str],
                dense_device: torch.device) -> DLRMTrain:
    """An unsharded DLRMTrain whose tables live on the meta device (the DMP allocates their shards).

    The dense layers are initialized from ``config.init_seed`` on every rank alike.

    Raises:
        ConfigError: ``config.shared_tables`` names a feature not in ``features``.
    """
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=name, embedding_dim=config.embedding_dim, num_embeddings=rows,
                               feature_names=names)
            for name, (rows, names) in table_features(config, table_rows, features).items()
        ],
        device=torch.device("meta"),
    )
    torch.manual_seed(config.init_seed)
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=list(config.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(config.over_arch_layer_sizes),
        dense_device=dense_device,
    )
    return DLRMTrain(dlrm)


def make_sharder(optimizer: str, lr: float, eps: float = 1e-8) -> EmbeddingBagCollectionSharder:
    """An EBC sharder whose tables are updated by FBGEMM's fused ``optimizer`` inside the backward."""
    if optimizer not in EMBEDDING_OPTIMIZERS:
        raise ConfigError(f"embedding_optimizer: {optimizer!r} is not one of {sorted(EMBEDDING_OPTIMIZERS)}")
    fused = {"optimizer": EMBEDDING_OPTIMIZERS[optimizer], "learning_rate": lr}
    if optimizer != "sgd":
        fused["eps"] = eps
    return EmbeddingBagCollectionSharder(fused_params=fused)


def plan_assignment(table_rows: dict[str, int], dim: int, world_size: int, row_wise_min_rows: int) -> dict[str, object]:
    """Per table: ``"row_wise"`` or the rank (int) that holds it whole. Deterministic on every rank."""
    out: dict[str, object] = {}
    load = [0] * world_size
    small = []
    for name, rows in table_rows.items():
        if rows >= row_wise_min_rows and world_size > 1:
            out[name] = "row_wise"
            for r in range(world_size):
                load[r] += rows * dim // world_size
        else:
            small.append(name)
    for name in sorted(small, key=lambda n: (-table_rows[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += table_rows[name] * dim
    return out


def build_plan(model: DLRMTrain, sharder: EmbeddingBagCollectionSharder, world_size: int,
               row_wise_min_rows: int, device_type: str = "cpu") -> ShardingPlan:
    """A plan that splits big tables by rows and places the others whole, every one with the fused kernel."""
    ebc = model.model.sparse_arch.embedding_bag_collection
    configs = ebc.embedding_bag_configs()
    dim = configs[0].embedding_dim
    assignment = plan_assignment({c.name: c.num_embeddings for c in configs}, dim, world_size, row_wise_min_rows)
    per_param = {
        name: row_wise(compute_kernel="fused") if where == "row_wise" else table_wise(rank=int(where),
                                                                                       compute_kernel="fused")
        for name, where in assignment.items()
    }
    module_plan = construct_module_sharding_plan(
        ebc, per_param_sharding=per_param, local_size=world_size, world_size=world_size,
        device_type=device_type, sharder=sharder,
    )
    n_rw = sum(1 for w in assignment.values() if w == "row_wise")
    log.info("plan: %d tables row_wise, %d table_wise over %d ranks", n_rw, len(assignment) - n_rw, world_size)
    return ShardingPlan({EBC_FQN: module_plan})


def dense_parameters(model: nn.Module, sharded_fqns: list[str]) -> list[tuple[str, nn.Parameter]]:
    """The parameters outside the sharded embedding modules: what the dense optimizer updates."""
    out = []
    for name, p in model.named_parameters():
        clean = name.removeprefix("module.")
        if any(clean == m or clean.startswith(m + ".") for m in sharded_fqns):
            continue
        out.append((name, p))
    return out
