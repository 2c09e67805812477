"""What a follower serves into, by table name: the float tables of an unsharded model or a state_dict, or the
quantized tables of TorchRec's inference modules.

In a module, every unsharded ``EmbeddingBagCollection`` and ``EmbeddingCollection`` gives its tables'
weights, and every FBGEMM ``IntNBitTableBatchedEmbeddingBagsCodegen`` (what TorchRec's
``quantize_inference_model`` builds, for pooled and sequence tables alike) its tables by the names in its
``embedding_specs``. A state_dict gives the tensors under the names the checkpoint's ``table_fqns``
record. Each table is a :class:`Sink`: given whole float32 rows, it writes them in its own form.

A quantized row is quantized as TorchRec's own conversion quantizes a table
(``torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``, row by row, so a row's bytes depend on
that row alone), laid out as the TBE holds it (its fp16 scale and bias first, then the codes, then the
row's padding as it was) and written with FBGEMM's ``embedding_inplace_update``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.errors import ConfigError

__all__ = ["Dense", "FloatSink", "FusedSink", "McSink", "QuantSink", "Sink", "Tables", "dense_of", "sinks_of"]


class Sink(Protocol):
    """One served table."""

    shape: tuple[int, int]

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Writes float32 ``values`` (``[len(rows), dim]``, whole rows) to rows ``rows``."""


@runtime_checkable
class Tables(Protocol):
    """A target that gives its own tables for a checkpoint (``cnr publish``'s snapshot does)."""

    def sinks(self, tip: Manifest) -> dict[str, Sink]:
        """A sink per table of ``tip`` the target holds."""

    def write_dense(self, values: Mapping[str, torch.Tensor]) -> None:
        """Takes every dense parameter and buffer a checkpoint stores, by name."""


class FloatSink:
    """A float table (a module's weight, a state_dict's tensor): rows written in place, in its dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.shape = weight, (int(weight.shape[0]), int(weight.shape[1]))

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight[rows] = values.to(self.weight.dtype)


_BITS = {"int8": 8, "int4": 4, "int2": 2}


def quantize_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 rows quantized as TorchRec's inference conversion quantizes a table: FBGEMM's fused row-wise
    layout, each row's codes then its fp16 scale and bias (a row's bytes depend on that row alone)."""
    return torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(values.contiguous(), bits)


class FusedSink:
    """A table held as FBGEMM's fused row-wise ``bits``-bit rows (``rows``: uint8, one row per table row), as
    ``cnr publish`` writes it; ``rows`` is allocated where None or of another shape."""

    def __init__(self, rows: torch.Tensor | None, num_rows: int, dim: int, bits: int) -> None:
        width = quantize_rows(torch.zeros(1, dim), bits).shape[1]
        if rows is None or tuple(rows.shape) != (num_rows, width):
            rows = torch.zeros(num_rows, width, dtype=torch.uint8)
        self.rows, self.bits, self.shape = rows, bits, (num_rows, dim)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.rows[rows] = quantize_rows(values, self.bits)


class QuantSink:
    """Table ``index`` of an FBGEMM inference TBE (int8/int4/int2 row-wise with fp16 scale and bias, fp16, fp32)."""

    def __init__(self, tbe: Any, index: int, rows: int, dim: int, weight_type: Any) -> None:
        self.tbe, self.index, self.shape = tbe, index, (rows, dim)
        self.kind = str(weight_type.value)
        if self.kind not in (*_BITS, "fp16", "fp32"):
            raise ConfigError(f"table '{tbe.embedding_specs[index][0]}' is stored as {self.kind}; a follower "
                              f"writes {sorted((*_BITS, 'fp16', 'fp32'))}")

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if not rows.numel():
            return
        current = self.tbe.split_embedding_weights(split_scale_shifts=False)[self.index][0]
        out = current.index_select(0, rows.to(current.device)).clone()  # the padding stays as it was
        if self.kind in _BITS:
            fused = quantize_rows(values, _BITS[self.kind])
            codes = fused.shape[1] - 4
            out[:, :4] = fused[:, codes:]  # the TBE's row: scale and bias first, then the codes
            out[:, 4 : 4 + codes] = fused[:, :codes]
        else:
            raw = values.to(torch.float16 if self.kind == "fp16" else torch.float32).contiguous().view(torch.uint8)
            out[:, : raw.shape[1]] = raw
        self.tbe.embedding_inplace_update([self.index], [rows.tolist()], [out.to(current.device)])


class McSink:
    """A managed-collision table of an unsharded ``ManagedCollisionEmbedding(Bag)Collection``: its rows through
    ``inner``, its remapping through its ``MCHManagedCollisionModule``, whose sorted buffers are rebuilt from
    the whole table's state by row as a restore rebuilds a shard's
    (:meth:`~cnr_torchrec.track.managed_collision.McTable.load_by_row`): a raw id then remaps to the row
    that holds it, and an evicted one to no row of its own (TorchRec's miss row)."""

    def __init__(self, table: str, inner: Sink, mch: Any) -> None:
        from cnr_torchrec.track.managed_collision import McTable

        self.inner, self.shape, self.mc = inner, inner.shape, McTable(table, None, mch)
        if self.mc.num_rows != self.shape[0] or self.mc.start != 0:
            raise ConfigError(f"table '{table}': its managed-collision module holds {self.mc.num_rows} slots from row "
                              f"{self.mc.start}, the table {self.shape[0]} rows; serve an unsharded module")

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.inner.write(rows, values)

    def write_remapping(self, state: torch.Tensor) -> None:
        """Rebuilds the module's remapping from ``state`` (int64 ``[rows, len(fields)]``, raw id first)."""
        self.mc.load_by_row(state)


class Dense:
    """The dense parameters and buffers a target serves, by the training model's names: ``tensors`` (written in
    place), or, where None, every one a checkpoint stores, handed to ``take``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None, take: Any = None) -> None:
        self.tensors, self.take = tensors, take

    @property
    def names(self) -> list[str] | None:
        return None if self.tensors is None else sorted(self.tensors)

    def check(self, values: Mapping[str, torch.Tensor], where: str) -> None:
        """Raises IncompatibleCheckpointError for a value of another shape than the target's tensor."""
        from cnr_torchrec.errors import IncompatibleCheckpointError

        for name, v in values.items():
            have = None if self.tensors is None else self.tensors[name]
            if have is not None and tuple(have.shape) != tuple(v.shape):
                raise IncompatibleCheckpointError(f"{where} holds dense {name!r} as {list(v.shape)}, the target as "
                                                  f"{list(have.shape)}: the root is another model's")

    def write(self, values: Mapping[str, torch.Tensor]) -> None:
        if self.tensors is None:
            self.take(values)
            return
        with torch.no_grad():
            for name, v in values.items():
                self.tensors[name].copy_(v)


def dense_of(target: nn.Module | Mapping[str, torch.Tensor] | Tables, table_fqns: Mapping[str, str]) -> Dense:
    """What of a checkpoint's dense state ``target`` serves: a module's parameters and buffers by their
    state_dict names, a state_dict's tensors other than the tables, or all of it for a :class:`Tables`."""
    if isinstance(target, Tables):
        return Dense(None, target.write_dense)
    tables = set(table_fqns.values())
    tensors = target.state_dict(keep_vars=True) if isinstance(target, nn.Module) else target
    return Dense({name: t for name, t in tensors.items() if name not in tables and isinstance(t, torch.Tensor)})


def sinks_of(target: nn.Module | MutableMapping[str, torch.Tensor], table_fqns: Mapping[str, str]) -> dict[str, Sink]:
    """The tables of ``target`` by name.

    Raises:
        ConfigError: a module that holds no table to serve, or a sharded one; a state_dict with none of the
            checkpoint's table names.
    """
    if isinstance(target, nn.Module):
        return _module_sinks(target)
    found: dict[str, Sink] = {t: FloatSink(target[name]) for t, name in table_fqns.items() if name in target}
    if not found:
        raise ConfigError(f"the state_dict given to follow holds none of the checkpoint's tables (it names them "
                          f"{sorted(table_fqns.values())[:4]}...); pass the training model's state_dict, or an "
                          "unsharded model")
    return found


def _module_sinks(model: nn.Module) -> dict[str, Sink]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    out: dict[str, Sink] = {}
    remapped: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseManagedCollisionEmbeddingCollection):
            for table, mch in module._managed_collision_collection._managed_collision_modules.items():
                if type(mch) is not MCHManagedCollisionModule:
                    raise ConfigError(f"table '{table}' is remapped by a {type(mch).__name__}; a follower serves "
                                      "sort-zch tables (MCHManagedCollisionModule), as the checkpoints hold them")
                remapped[table] = mch
        elif isinstance(module, IntNBitTableBatchedEmbeddingBagsCodegen):
            for i, (table, rows, dim, weight_type, *_) in enumerate(module.embedding_specs):
                out[table] = QuantSink(module, i, rows, dim, weight_type)
        elif isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            tables = module.embedding_bags if isinstance(module, EmbeddingBagCollection) else module.embeddings
            for table, emb in tables.items():
                if emb.weight.is_meta:
                    raise ConfigError(f"{name}.{table} is on the meta device; build the serving model on a real "
                                      "device")
                out[table] = FloatSink(emb.weight)
        elif type(module).__name__.startswith("Sharded"):
            raise ConfigError(f"{name or 'the model'} is sharded ({type(module).__name__}); a follower serves an "
                              "unsharded model (build it as TorchRec's inference does, without "
                              "DistributedModelParallel)")
    for table, mch in remapped.items():
        out[table] = McSink(table, out[table], mch)
    if not out:
        raise ConfigError(f"{type(model).__name__} holds no EmbeddingBagCollection, EmbeddingCollection or "
                          "quantized embedding tables to serve")
    return out
