"""Reading DCP checkpoints safely (an allow-listed metadata unpickler), and loading them into a DMP:
:class:`DMPLoadPlanner` and the dense optimizer by parameter name."""

from __future__ import annotations

import logging
import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from cnr_torchrec.ckpt.live.dense_optim import (
    TORCH_OPTIM,
    SavedDenseOptimizer,
    load_dense_state,
    state_to_save,
)
from cnr_torchrec.ckpt.live.dense_optim_named import from_fqn
from cnr_torchrec.ckpt.tools.dcp.dmp_keys import DENSE_OPTIM, LEGACY_MODEL, OPTIM, _column_shards
from cnr_torchrec.errors import (
    CheckpointNotFoundError,
    CnrError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["DMPLoadPlanner", "dense_optimizer_state_dict", "load_dense_optimizer"]

log = logging.getLogger(__name__)


def _dcp_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``dcp.save``/``dcp.load`` in this process alone, raising our named errors rather than DCP's wrapper."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return fn(*args, **kwargs)
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, (CnrError, OSError)):
                raise exc from None
        raise


_PICKLED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"), *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath"))}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: its dataclasses, ``torch.Size``, dtypes, layouts and paths."""

    def find_class(self, module: str, name: str) -> Any:
        found = None
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _PICKLED:
            found = super().find_class(module, name)
            if module.startswith("torch.distributed") and getattr(found, "__module__", None) != module:
                found = None  # what the module defines, not what it imports
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), (
                torch.dtype, torch.layout, torch.memory_format))):
            found = getattr(torch, name)
        if found is None:
            raise UnsafeCheckpointError(f"DCP metadata asks to unpickle {module}.{name}, which it never holds; "
                                        "refusing it (it could run code). Import only what dcp.save wrote")
        return found


def _metadata(path: str) -> Metadata:
    """The DCP metadata in directory ``path``: CheckpointNotFoundError if it has none, CorruptCheckpointError if
    it does not load, UnsafeCheckpointError if it pickles what DCP never writes."""
    file = os.path.join(path, ".metadata")
    if not os.path.isfile(file):
        raise CheckpointNotFoundError(f"{path} holds no DCP checkpoint (no .metadata): pass the directory that "
                                      "dcp.save wrote (its checkpoint_id), once the save has finished")
    with open(file, "rb") as f:
        try:
            md = _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as e:
            raise UnsafeCheckpointError(f"{file}: {e}") from None
        except Exception as e:  # truncated or foreign bytes: pickle raises many kinds
            raise CorruptCheckpointError(f"{file} does not load ({type(e).__name__}: {e})", path=file) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{file} holds a {type(md).__name__}, not DCP metadata", path=file)
    return md


class _SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata goes through :func:`_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = _metadata(str(self.path))
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _path(md: Metadata, key: str) -> tuple[Any, ...]:  # the nested path of a flat key
    return tuple((md.planner_data or {}).get(key, (key,)))


def _read(path: str, wanted: dict[str, Any]) -> dict[str, Any]:
    """Loads the flat keys of ``wanted`` (tensors to fill, or None for other values) in this process."""
    if wanted:
        _dcp_call(dcp.load, wanted, storage_reader=_SafeReader(path), planner=DMPLoadPlanner(), no_dist=True)
    return wanted


def _empty(m: Any) -> torch.Tensor | None:  # what a saved value loads into (None: not a tensor)
    return torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None


def _read_tree(path: str, md: Metadata, top: str) -> Any:
    """The nested value saved under top-level key ``top`` (None if there is none)."""
    got = _read(path, {k: _empty(m) for k, m in md.state_dict_metadata.items() if _path(md, k)[0] == top})
    tree: dict[str, Any] = {}
    for k, v in got.items():
        set_element(tree, _path(md, k), v)
    return tree.get(top)


@dataclass
class _Remap:
    """Row-wise state of one table on this rank: the saved column shards it needs, read into buffers, then put
    on each local shard by column overlap (the column-width-weighted mean, as a restore computes it)."""

    targets: list[tuple[torch.Tensor, int, list[tuple[int, float]]]]  # shard, first row, [(saved shard, weight)]
    parts: dict[int, tuple[int, torch.Tensor]]  # saved shard -> (first row read, the rows read)
    items: list[ReadItem]
    pending: int

    @classmethod
    def build(cls, fqn: str, live: ShardedTensor, saved: TensorStorageMetadata, rows: int,
              src: list[tuple[int, int]], dst: list[tuple[int, int]],
              buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor]) -> _Remap:
        targets: list[Any] = []
        spans: dict[Any, Any] = {}
        for shard in live.local_shards():
            start, n = int(shard.metadata.shard_offsets[0]), int(shard.metadata.shard_sizes[0])
            seg, r0 = divmod(start, rows)
            if r0 + n > rows:
                raise IncompatibleCheckpointError(f"{fqn}: shard [{start}, {start + n}) crosses a column shard")
            c0, c1 = dst[seg]
            weights = [(s, (min(b, c1) - max(a, c0)) / (c1 - c0)) for s, (a, b) in enumerate(src)
                       if max(a, c0) < min(b, c1)]
            targets.append((shard.tensor, r0, weights))
            for s, _ in weights:
                lo, hi = spans.get(s, (r0, r0 + n))
                spans[s] = (min(lo, r0), max(hi, r0 + n))
        parts, items = {}, []
        for s, (lo, hi) in sorted(spans.items()):
            start = s * rows + lo
            buffers[(fqn, (start,))] = buf = torch.empty(hi - lo, dtype=saved.properties.dtype)
            parts[s] = (lo, buf)
            chunk = ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([hi - lo]))
            items += create_read_items_for_chunk_list(fqn, saved, [chunk])
        return cls(targets, parts, items, len(items))

    def finish(self) -> None:
        for live, r0, weights in self.targets:
            vals = [self.parts[s][1][r0 - self.parts[s][0]:][: live.shape[0]] for s, _ in weights]
            if len(weights) == 1 and weights[0][1] == 1.0:  # inside one saved shard: its value
                merged = vals[0]
            else:
                total = sum((v.double() * w for v, (_, w) in zip(vals, weights)), torch.zeros((), dtype=torch.float64))
                merged = total / sum(w for _, w in weights)
            with torch.no_grad():
                live.copy_(merged)


class DMPLoadPlanner(DefaultLoadPlanner):
    """``dcp.load(state_dict, checkpoint_id=..., planner=DMPLoadPlanner())`` into a DMP of any plan, where
    ``state_dict`` is ``dmp.state_dict()``, alone or with ``optim`` (``dmp.fused_optimizer.state_dict()``) beside
    its keys; or, for a checkpoint of the older layout, ``{"model": dmp.state_dict(), "optim": ...}``.

    On top of DefaultLoadPlanner (weights reshard by FQN), for the module's layout: (1) row-wise fused state
    whose column shards differ from the saved ones is read per saved column shard and put on each local shard
    by column overlap: a shard inside one saved shard takes its value, one spanning several their column-width-
    weighted mean, as ``Checkpointer.restore`` does; (2) optimizer state (``optim``, ``dense_optim``) the
    checkpoint lacks stays as it is, listed in ``skipped``; (3) other values load with ``weights_only=True``.
    A model key the checkpoint lacks fails, as with DefaultLoadPlanner.
    """

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[str] = []
        self._remaps: dict[str, _Remap] = {}
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # DCP sets it (set_up_planner) before it asks for the plan
        plain, extra = {}, []  # keys DCP plans as usual; the remaps' reads
        for fqn, obj in self.state_dict.items():
            path = tuple(self.mappings.get(fqn, (fqn,)))
            if fqn not in self.metadata.state_dict_metadata and path[0] in (OPTIM, DENSE_OPTIM):
                self.skipped.append(fqn)
            elif (remap := self._remap(fqn, path, obj)) is not None:
                self._remaps[fqn] = remap
                extra += remap.items
            else:
                plain[fqn] = obj
        if self.skipped:
            log.warning("optimizer state not in the checkpoint, left as it is: %s", self.skipped)
        return LoadPlan(create_default_local_load_plan(plain, self.metadata, not self.allow_partial_load).items
                        + extra)

    def _remap(self, fqn: str, path: tuple[Any, ...], live: Any) -> _Remap | None:
        """The remap of row-wise state ``fqn`` if its column shards differ from the saved ones, else None."""
        assert self.metadata is not None  # DCP sets it (set_up_planner) before it asks for the plan
        md = self.metadata.state_dict_metadata
        saved = md.get(fqn)
        if not (len(path) == 4 and path[:2] == (OPTIM, "state") and isinstance(live, ShardedTensor)
                and live.dim() == 1 and isinstance(saved, TensorStorageMetadata) and len(saved.size) == 1):
            return None
        wkey = str(path[2])  # the weight: a top-level model key, or under ``model`` in the older layout
        if wkey not in self.state_dict:
            wkey = f"{LEGACY_MODEL}.{wkey}"
        wsaved, wlive = md.get(wkey), self.state_dict.get(wkey)
        if not (isinstance(wsaved, TensorStorageMetadata) and len(wsaved.size) == 2
                and isinstance(wlive, ShardedTensor)):
            return None
        rows, dim = int(wsaved.size[0]), int(wsaved.size[1])
        if rows == 0 or saved.size[0] % rows or live.size(0) % rows:
            return None  # not row-wise state of that weight: DCP's own checks apply
        src = _column_shards([(c.offsets, c.sizes) for c in wsaved.chunks], rows, dim, saved.size[0] // rows, wkey)
        dst = _column_shards([(m.shard_offsets, m.shard_sizes) for m in wlive.metadata().shards_metadata], rows,
                             dim, live.size(0) // rows, wkey)
        return None if src == dst else _Remap.build(fqn, live, saved, rows, src, dst, self._buffers)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buf = self._buffers.get((read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ())))
        if buf is None:
            return super().resolve_tensor(read_item)
        return narrow_tensor_by_index(buf, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        remap = self._remaps.get(read_item.dest_index.fqn)
        if remap is not None:
            remap.pending -= 1
            if remap.pending == 0:  # every saved shard it needs has landed
                remap.finish()

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=True))


def dense_optimizer_state_dict(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The dense optimizer's state by parameter FQN (positions change with the plan; torch's
    ``get_optimizer_state_dict`` does not take a DMP), to save under ``dense_optim``: a torch.optim
    optimizer's remapped from positions, a TorchRec KeyedOptimizer's as its ``state_dict()`` keys it
    (with its ``param_groups``).

    Raises:
        ConfigError: a torch.optim optimizer holds a parameter that is not the model's, or the optimizer is
            neither torch.optim nor a KeyedOptimizer (its state has no parameter names).
    """
    record = SavedDenseOptimizer.from_tree(state_to_save(model, optimizer), "dense_optimizer")
    out = record.by_fqn()
    if out is None:
        raise ConfigError(f"a {record.cls} keeps its state in its own layout, not by parameter name; save "
                          f"its state_dict() under a key of your own instead of '{DENSE_OPTIM}'")
    return out


def load_dense_optimizer(checkpoint_id: str, model: torch.nn.Module, optimizer: Any) -> None:
    """Loads ``dense_optim`` of the DCP checkpoint in ``checkpoint_id`` into ``optimizer`` by parameter name, as
    a restore does: every rank reads it whole; a parameter without saved state keeps a fresh one (logged).
    ``optimizer`` is a torch.optim optimizer or a TorchRec KeyedOptimizer.

    Raises:
        CheckpointNotFoundError: no DCP checkpoint there, or one without ``dense_optim``.
        IncompatibleCheckpointError: a parameter's state has another shape, ``dense_optim`` is malformed, or
            ``optimizer`` keeps its state in a layout of its own.
    """
    tree = _read_tree(checkpoint_id, _metadata(checkpoint_id), DENSE_OPTIM)
    if tree is None:
        raise CheckpointNotFoundError(f"{checkpoint_id} holds no '{DENSE_OPTIM}'; leave the dense optimizer fresh")
    where = f"DCP checkpoint {checkpoint_id}: '{DENSE_OPTIM}'"
    load_dense_state(model, optimizer, SavedDenseOptimizer(TORCH_OPTIM, None, from_fqn(tree, where)).to_tree(), where)
