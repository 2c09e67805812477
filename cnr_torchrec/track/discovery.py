"""Finds the FBGEMM TBEs inside a sharded model and maps their rows to global ids.

TorchRec hides the kernels from ``named_modules()``: each sharded EBC/EC keeps one
lookup per sharding type in ``_lookups`` (data_parallel ones wrapped in DDP), and
each lookup's ``_emb_modules`` holds kernels whose ``emb_module`` is the TBE. A sharded
managed-collision module keeps its EBC/EC in ``_embedding_module``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingType

from cnr_torchrec.errors import UnsupportedShardingError
from cnr_torchrec.track.managed_collision import inner_module
from cnr_torchrec.track.tbe_cache import why_cache_inexact
from cnr_torchrec.track.torchrec_types import TorchRecModule

__all__ = ["ShardSlice", "TrackedKernel", "find_kernels", "plan_table_shapes"]

# Compute kernels whose TBE updates exactly the rows it looks up (fused optimizers).
_FUSED_KERNELS = frozenset({"fused", "fused_uvm", "fused_uvm_caching"})
_SHARDED_TYPES = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)


@dataclass(frozen=True)
class ShardSlice:
    """One shard of one table held by a TBE on this rank.

    Attributes:
        table: table name, as in the EmbeddingBagConfig / EmbeddingConfig.
        flat_start: first row of the shard in its TBE's flat row space.
        rows: global row range ``[start, end)``.
        cols: global column range ``[start, end)``.
        local_index: position of the shard among the TBE's tables, i.e. in
            ``split_embedding_weights()``.
    """

    table: str
    flat_start: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    local_index: int

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass
class TrackedKernel:
    """A TBE on this rank and the shards it holds."""

    module_fqn: str
    sharding_type: str
    kernel: TorchRecModule
    tbe: TorchRecModule
    num_rows: int
    shards: list[ShardSlice] = field(default_factory=list)

    @property
    def data_parallel(self) -> bool:
        return self.sharding_type == ShardingType.DATA_PARALLEL.value


def _unwrap(lookup: TorchRecModule) -> TorchRecModule:
    # Data-parallel lookups are wrapped in DistributedDataParallel.
    return lookup.module if hasattr(lookup, "module") and hasattr(lookup.module, "_emb_modules") else lookup


def plan_table_shapes(dmp: TorchRecModule) -> dict[str, dict[str, object]]:
    """Every sharded table of the plan, with its module, sharding type and compute kernel.

    Raises:
        UnsupportedShardingError: a table name appears in two sharded modules, or a
            table uses a compute kernel whose row updates cannot be tracked.
    """
    tables: dict[str, dict[str, object]] = {}
    bad: list[str] = []
    for module_fqn, module_plan in dmp.plan.plan.items():
        for table, ps in module_plan.items():
            if table in tables:
                raise UnsupportedShardingError(
                    f"table '{table}' appears in both '{tables[table]['module']}' and '{module_fqn}'; "
                    "give every embedding table a unique name so checkpoints can address it"
                )
            tables[table] = {
                "module": module_fqn,
                "sharding_type": ps.sharding_type,
                "compute_kernel": ps.compute_kernel,
                "bounds_check_mode": getattr(ps, "bounds_check_mode", None),
            }
            dp = ps.sharding_type == ShardingType.DATA_PARALLEL.value
            if not dp and ps.compute_kernel not in _FUSED_KERNELS:
                bad.append(f"'{table}' ({ps.sharding_type}, compute_kernel={ps.compute_kernel!r})")
    if bad:
        raise UnsupportedShardingError(
            "cannot track dirty rows of " + ", ".join(bad) + ": only FBGEMM TBEs with a fused optimizer "
            f"({', '.join(sorted(_FUSED_KERNELS))}) or data_parallel tables are supported. Set "
            "compute_kernel='fused' on those tables in the sharding plan."
        )
    return tables


def find_kernels(dmp: TorchRecModule) -> list[TrackedKernel]:
    """All TBE kernels of the sharded EBCs/ECs inside ``dmp`` on this rank.

    Raises:
        UnsupportedShardingError: a sharded module type we cannot see into, or a
            kernel whose ``emb_module`` is not an FBGEMM TBE.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        DenseTableBatchedEmbeddingBagsCodegen,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe_types = (SplitTableBatchedEmbeddingBagsCodegen, DenseTableBatchedEmbeddingBagsCodegen)
    planned = set(dmp.plan.plan.keys())
    found: list[TrackedKernel] = []
    seen_modules: set[str] = set()
    for fqn, module in dmp.module.named_modules():
        if fqn not in planned:
            continue
        module = inner_module(module) or module  # a managed-collision module: its tables' EBC/EC
        if not isinstance(module, _SHARDED_TYPES):
            tables = ", ".join(sorted(dmp.plan.plan[fqn].keys()))
            raise UnsupportedShardingError(
                f"module '{fqn}' (tables {tables}) was sharded as {type(module).__name__}; CheckNRunDMP tracks "
                "EmbeddingBagCollection and EmbeddingCollection, and their managed-collision (sort-zch) forms, only"
            )
        seen_modules.add(fqn)
        for sharding_type, lookup in zip(module._sharding_types, module._lookups):
            for kernel in _unwrap(lookup)._emb_modules:
                tbe = getattr(kernel, "emb_module", None)
                names = [t.name for t in kernel.config.embedding_tables]
                if not isinstance(tbe, tbe_types):
                    raise UnsupportedShardingError(
                        f"tables {names} in '{fqn}' run on {type(tbe).__name__}, not an FBGEMM TBE; "
                        "use compute_kernel='fused' for them"
                    )
                inexact = why_cache_inexact(tbe)
                if inexact is not None:
                    raise UnsupportedShardingError(
                        f"tables {names} in '{fqn}' run on a caching TBE that cannot be checkpointed exactly: "
                        f"{inexact}. Give the cache the weights' precision (fused_params cache_precision) or use "
                        "compute_kernel='fused_uvm' for them"
                    )
                found.append(_describe(fqn, sharding_type, kernel, tbe))
    return found


def _describe(fqn: str, sharding_type: str, kernel: TorchRecModule, tbe: TorchRecModule) -> TrackedKernel:
    tables = kernel.config.embedding_tables
    shards: list[ShardSlice] = []
    flat = 0
    for i, t in enumerate(tables):
        md = t.local_metadata
        if md is None:  # data_parallel: the whole table, replicated
            row0, col0 = 0, 0
        else:
            row0, col0 = int(md.shard_offsets[0]), int(md.shard_offsets[1])
        shards.append(
            ShardSlice(t.name, flat, (row0, row0 + t.local_rows), (col0, col0 + t.local_cols), local_index=i)
        )
        flat += t.local_rows
    hsc = getattr(tbe, "hash_size_cumsum", None)
    rows = getattr(tbe, "rows_per_table", None)
    ftm = getattr(tbe, "feature_table_map", None)
    if ftm is not None and hsc is not None:
        # The hook maps ids through the TBE's per-feature hash_size_cumsum and rows_per_table
        # (features of a shared table repeat its entries); both must agree with our shard layout.
        starts = torch.tensor([shards[t].flat_start for t in ftm] + [flat], dtype=torch.int64)
        sizes = torch.tensor([shards[t].num_rows for t in ftm], dtype=torch.int64)
        if not torch.equal(hsc.detach().cpu().long(), starts) or (
            rows is not None and not torch.equal(rows.detach().cpu().long(), sizes)
        ):
            raise UnsupportedShardingError(
                f"unexpected TBE row layout for tables {[s.table for s in shards]} in '{fqn}': "
                f"hash_size_cumsum={hsc.tolist()} and rows_per_table="
                f"{None if rows is None else rows.tolist()} do not match the shard sizes"
            )
    return TrackedKernel(fqn, sharding_type, kernel, tbe, flat, shards)
