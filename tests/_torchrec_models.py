"""TorchRec's own test models as fixtures: TestSparseNN (pooled and weighted tables) and
TestMixedEmbeddingSparseArch (pooled and sequence tables), sharded by hand-built plans and fed by
TorchRec's ModelInput generators.

Every model here has tables that several features share (two and three per table), so the tracker's
per-feature row mapping is exercised the way real models use it. Table names do not name a sharding
type: every table but ``trio`` (table_wise in both, on another rank) changes sharding type between
plans ``"A"`` and ``"B"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, EmbeddingConfig

NUM_FLOAT = 6
BATCH = 8
POOLING = 3


@dataclass(frozen=True)
class Table:
    """One table of a fixture model, with its sharding type in each plan.

    Attributes:
        name: table name.
        rows: num_embeddings.
        dim: embedding_dim.
        features: the features that look up this table.
        kind: ``"ebc"`` (pooled), ``"weighted"`` (pooled, id-score) or ``"ec"`` (sequence).
        plans: sharding type per plan name (``"A"``, ``"B"``, ``"VBE"``).
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    kind: str
    plans: dict[str, str]

    def config(self) -> EmbeddingBagConfig | EmbeddingConfig:
        cls = EmbeddingConfig if self.kind == "ec" else EmbeddingBagConfig
        return cls(name=self.name, num_embeddings=self.rows, embedding_dim=self.dim, feature_names=list(self.features))


# TestSparseNN: mixed dims (4, 8, 16), two and three features per table, id-score tables, and every
# EBC sharding type in each plan. PLAN "A" is laid out for 2 ranks and "B" for 1 (both also run on 2).
# Plan "VBE" uses only the sharding types whose variable-batch path works on CPU (see test file).
# Plan "UNEVEN" (2 ranks) cuts the two 16-dim tables into column shards of widths 4 and 12 (FBGEMM
# needs a multiple of 4 columns per shard); plan "TW" puts every table whole on one rank.
SPARSE_NN = (
    Table("user_item", 48, 8, ("f_user", "f_item"), "ebc",
          {"A": "table_wise", "B": "row_wise", "VBE": "table_wise"}),
    Table("abc", 56, 16, ("f_a", "f_b", "f_c"), "ebc",
          {"A": "row_wise", "B": "column_wise", "VBE": "column_wise", "UNEVEN": "column_wise_uneven"}),
    Table("pair", 64, 16, ("f_p", "f_q"), "ebc",
          {"A": "column_wise", "B": "table_row_wise", "VBE": "table_wise", "UNEVEN": "column_wise_uneven"}),
    Table("solo", 40, 4, ("f_solo",), "ebc",
          {"A": "table_row_wise", "B": "data_parallel", "VBE": "column_wise"}),
    Table("repl", 48, 8, ("f_r1", "f_r2"), "ebc",
          {"A": "data_parallel", "B": "table_wise", "VBE": "table_wise"}),
    Table("trio", 40, 4, ("f_x", "f_y", "f_z"), "ebc",
          {"A": "table_wise", "B": "table_wise", "VBE": "column_wise"}),
    Table("scored", 56, 8, ("w_a", "w_b"), "weighted",
          {"A": "row_wise", "B": "table_wise", "VBE": "table_wise"}),
    Table("scored1", 40, 4, ("w_c",), "weighted",
          {"A": "table_wise", "B": "column_wise", "VBE": "column_wise"}),
)

# TestMixedEmbeddingSparseArch: sequence tables (one dim, as EmbeddingCollection requires) sharing
# features, beside one pooled table. No sequence table is data_parallel: on CPU, torchrec's
# data_parallel EmbeddingCollection runs the dense TBE, which pools each bag even for sequence
# tables, and its output dist then fails ("split_with_sizes expects split_sizes to sum exactly to
# 16 ... but got split_sizes=[19, 23]"), even with no other sharding type beside it. Checked with plain
# DistributedModelParallel on 1 rank and CheckNRunDMP on 2: a torchrec/FBGEMM CPU limitation, not ours.
MIXED = (
    Table("seq2", 48, 8, ("s_a", "s_b"), "ec", {"A": "table_wise", "B": "row_wise"}),
    Table("seq3", 56, 8, ("s_c", "s_d", "s_e"), "ec", {"A": "row_wise", "B": "column_wise"}),
    Table("seq1", 64, 8, ("s_f",), "ec", {"A": "column_wise", "B": "table_wise"}),
    Table("bag", 40, 4, ("m_a", "m_b"), "ebc", {"A": "row_wise", "B": "data_parallel"}),
)

MODELS = {"sparse_nn": SPARSE_NN, "mixed": MIXED}


def tables_of(model: str) -> dict[str, Table]:
    """The tables of fixture ``model`` (``"sparse_nn"`` or ``"mixed"``), by name."""
    return {t.name: t for t in MODELS[model]}


def make_model(model: str, sparse_device: str = "meta", mixed_device: str = "cpu") -> torch.nn.Module:
    """The unsharded TorchRec test model (embedding tables on meta, which sharding materialises, unless
    ``sparse_device`` says otherwise; ``"mixed"``'s on ``mixed_device``)."""
    from torchrec.distributed.test_utils.test_model import TestMixedEmbeddingSparseArch, TestSparseNN

    tables = MODELS[model]
    if model == "sparse_nn":
        return TestSparseNN(
            tables=[t.config() for t in tables if t.kind == "ebc"],
            weighted_tables=[t.config() for t in tables if t.kind == "weighted"],
            num_float_features=NUM_FLOAT,
            dense_device=torch.device("cpu"),
            sparse_device=torch.device(sparse_device),
        )
    return TestMixedEmbeddingSparseArch(
        tables=[t.config() for t in tables], num_float_features=NUM_FLOAT, dense_device=torch.device("cpu"),
        device=torch.device(mixed_device),
    )


def sharders(lr: float = 0.05) -> list:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr}
    return [EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused)]


def _generator(sharding: str, world_size: int, placed: int, dim: int):
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_row_wise, table_wise

    if sharding == "table_wise":
        return table_wise(rank=placed % world_size, compute_kernel="fused")
    if sharding == "row_wise":
        return row_wise(compute_kernel="fused")
    if sharding == "column_wise":
        # Two column shards per rank, so that each rank's TBE holds several pieces of one table.
        return column_wise(ranks=list(range(world_size)) * 2, compute_kernel="fused")
    if sharding == "column_wise_uneven":  # shard k on rank k: a quarter of the columns, then the rest
        return column_wise(size_per_rank=[dim // 4, dim - dim // 4], compute_kernel="fused")
    if sharding == "table_row_wise":
        return table_row_wise(host_index=0)
    if sharding == "data_parallel":
        return data_parallel()
    raise ValueError(sharding)


def build_plan(module: torch.nn.Module, model: str, plan: str, world_size: int, kinds: dict[str, str] | None = None):
    """A ShardingPlan for every EBC/EC inside ``module``, honouring each table's sharding type in ``plan``
    (or in ``kinds``, by table name, for a module of other tables)."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    by_name = tables_of(model)
    ebc_sharder, ec_sharder = sharders()
    out = {}
    for fqn, sub in module.named_modules():
        if isinstance(sub, EmbeddingBagCollection):
            configs, sharder = sub.embedding_bag_configs(), ebc_sharder
        elif isinstance(sub, EmbeddingCollection):
            configs, sharder = sub.embedding_configs(), ec_sharder
        else:
            continue
        names = [c.name for c in configs]
        kind_of = {n: kinds[n] if kinds is not None else by_name[n].plans.get(plan, "table_wise") for n in names}
        placed: dict[str, int] = {}
        gens = {}
        for c in configs:  # a plan that does not name a table: table_wise
            kind = kind_of[c.name]
            gens[c.name] = _generator(kind, world_size, placed.get(kind, 0), c.embedding_dim)
            placed[kind] = placed.get(kind, 0) + 1
        module_plan = construct_module_sharding_plan(
            sub, per_param_sharding=gens, local_size=world_size, world_size=world_size, device_type="cpu",
            sharder=sharder,
        )
        for n in names:
            if kind_of[n] == "table_row_wise":  # table_row_wise() takes no compute_kernel
                module_plan[n].compute_kernel = "fused"
        out[fqn] = module_plan
    return ShardingPlan(out)


def build_dmp(model: str, plan: str, *, seed: int = 0, dense_lr: float = 0.01, will_restore: object = False,
              mixed_device: str = "cpu"):
    """``make_model(model, mixed_device=mixed_device)`` sharded by ``plan`` in a CheckNRunDMP over the default
    group, and an Adam optimizer over what the fused table optimizers do not update (dense layers,
    data_parallel tables). ``will_restore``: as CheckNRunDMP takes it."""
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from cnr_torchrec import CheckNRunDMP

    torch.manual_seed(seed)
    module = make_model(model, mixed_device=mixed_device)
    dmp = CheckNRunDMP(
        module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=build_plan(module, model, plan, dist.get_world_size()), sharders=sharders(), will_restore=will_restore,
    )
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters()) if p.requires_grad]
    return dmp, torch.optim.Adam(dense, lr=dense_lr)


def make_batch(model: str, seed: int, *, variable_batch: bool = False):
    """One rank's batch from TorchRec's generators (``ModelInput`` / ``VariableBatchModelInput``).

    Both draw from the global RNGs, so they are seeded here: each (rank, step) gets its own batch.
    """
    import random

    from torchrec.distributed.embedding_types import EmbeddingTableConfig
    from torchrec.distributed.test_utils.model_input import ModelInput, VariableBatchModelInput

    tables = MODELS[model]
    unweighted = [t.config() for t in tables if t.kind != "weighted"]
    weighted = [t.config() for t in tables if t.kind == "weighted"]
    torch.manual_seed(seed)
    random.seed(seed)
    if variable_batch:
        # The variable-batch generator adds per-id scores only for configs that say is_weighted.
        weighted = [EmbeddingTableConfig(num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim, name=c.name,
                                         feature_names=c.feature_names, is_weighted=True) for c in weighted]
        return VariableBatchModelInput.generate(
            batch_size=BATCH // 2, num_float_features=NUM_FLOAT, dedup_factor=2, tables=unweighted,
            weighted_tables=weighted or None, pooling_avg=POOLING,
        )
    return ModelInput.generate(
        batch_size=BATCH, tables=unweighted, weighted_tables=weighted or None, num_float_features=NUM_FLOAT,
        pooling_avg=POOLING,
    )


def batch_ids(model: str, batch, *, referenced_only: bool = False) -> dict[str, torch.Tensor]:
    """Per table: the sorted unique ids the whole global batch looks up (every rank's KJTs, all features
    of the table), read from the input KJTs. The reference for what a training step may touch.

    Args:
        referenced_only: for a variable-batch KJT, only the ids of bags that some sample points back
            to through its ``inverse_indices`` (the others' embeddings reach no loss).
    """
    local = {}
    for t in MODELS[model]:
        kjt = batch.idscore_features if t.kind == "weighted" else batch.idlist_features
        jts = kjt.to_dict()
        parts = []
        for f in t.features:
            jt = jts[f]
            if referenced_only:
                keys, inverse = kjt.inverse_indices()
                bags = torch.unique(inverse[keys.index(f)])
                offsets = jt.offsets()
                parts += [jt.values()[offsets[b]:offsets[b + 1]] for b in bags.tolist()]
            else:
                parts.append(jt.values())
        local[t.name] = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {name: torch.unique(torch.cat([g[name] for g in gathered])) for name in local}


def train_step(dmp, opt, batch) -> None:
    loss, _ = dmp(batch)
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_tables(dmp, model: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """Whole tables assembled from every rank's shards: (weights, row-wise Adagrad state, data_parallel).

    A column shard keeps the mean of squared gradients over its own columns, so the whole-row state is
    the column-width-weighted mean of its shards' states.
    """
    tracker = dmp.dirty_tracker
    rank = dist.get_rank()
    out = {}
    for t in MODELS[model]:
        w = torch.zeros(t.rows, t.dim, dtype=torch.float64)
        m = torch.zeros(t.rows, dtype=torch.float64)
        dp = tracker.is_data_parallel(t.name)
        for k, s in tracker.shards(t.name):
            if dp and rank != 0:  # replicas are equal; count one
                continue
            w[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] = k.tbe.split_embedding_weights()[s.local_index].double()
            if not dp:
                state = k.tbe.split_optimizer_states()[s.local_index][0].reshape(-1).double()
                m[s.rows[0]:s.rows[1]] += state * (s.cols[1] - s.cols[0]) / t.dim
        if dist.get_world_size() > 1:
            dist.all_reduce(w)
            dist.all_reduce(m)
        out[t.name] = (w, m, dp)
    return out


def local_state(dmp, opt) -> dict:
    """Copies of this rank's table shards (weights and every fused optimizer state), the dense
    parameters and buffers, and the dense optimizer's state."""
    out = {}
    tracker = dmp.dirty_tracker
    sharded = tuple(m + "." for m in tracker.module_fqns())
    for t in tracker.tables():
        for i, (k, s) in enumerate(tracker.shards(t)):
            out[(t, i, "w")] = k.tbe.split_embedding_weights()[s.local_index].detach().clone()
            if not tracker.is_data_parallel(t):
                for j, st in enumerate(k.tbe.split_optimizer_states()[s.local_index]):
                    out[(t, i, j)] = st.detach().clone()
    for n, p in list(dmp.named_parameters()) + list(dmp.named_buffers()):
        clean = n.removeprefix("module.")
        if not clean.startswith(sharded):
            out[clean] = p.detach().clone()
    for i, st in opt.state_dict()["state"].items():
        for key, v in st.items():
            out[("dense_opt", i, key)] = v.detach().clone() if torch.is_tensor(v) else v
    return out


def dense_optimizer_state(dmp, opt) -> dict[str, dict]:
    """The dense optimizer's per-parameter state keyed by parameter name (copies)."""
    names = {id(p): n.removeprefix("module.") for n, p in dmp.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            out[names[id(p)]] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                 for k, v in opt.state.get(p, {}).items()}
    return out


def assert_same(got: dict, want: dict, what: str) -> None:
    """``got`` equals ``want`` key by key, tensors bit for bit; ``what`` names the comparison on failure."""
    assert got.keys() == want.keys(), (what, sorted(map(str, got.keys() ^ want.keys())))
    for key, ref in want.items():
        if torch.is_tensor(ref):
            assert torch.equal(got[key], ref), (what, key, (got[key].double() - ref.double()).abs().max())
        else:
            assert got[key] == ref, (what, key)
