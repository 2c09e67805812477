"""Interop with torch.distributed.checkpoint (DCP): ``cnr export --format dcp`` and ``cnr import-dcp``.

The layout is a DistributedModelParallel's own (docs/dcp.md): ``model`` (``dmp.state_dict()``), ``optim``
(``dmp.fused_optimizer.state_dict()``: ``optim.state.<weight FQN>.<table>.momentum1``, row-wise ``[rows]`` or
``[k * rows]`` for k column shards in column order, element-wise ``[rows, dim]``) and ``dense_optim`` (the
dense optimizer by parameter FQN).

**Export** writes the chunks of the tip's shard layout, as a DMP of that plan would save them. It streams:
:class:`_ExportPlanner` plans from the manifest alone and assembles a table (the chain applied to it alone) in
``resolve_data`` when DCP asks for its first chunk, once the previous one is dropped. Each chunk gets a file of
its own, since ``FileSystemWriter`` holds every tensor of a file until it closes. ``OUT`` is renamed from
``OUT.tmp-<pid>`` once DCP wrote ``.metadata``, so it only ever exists complete. **Load**: ``dcp.load``
reshards weights by FQN; :class:`DMPLoadPlanner` also maps row-wise state across column splits and leaves
optimizer state the checkpoint lacks alone. **Import** writes a baseline the way ``cnr compact`` does: ``none``
entries by :func:`~cnr_torchrec.ckpt.save.writer.write_rank`, a table at a time, then the sealed manifest. DCP's
metadata pickle is read through an allow-list, other values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          create_default_local_load_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from cnr_torchrec.ckpt.format.chunks import DEFAULT_CHUNK_BYTES, PayloadReader
from cnr_torchrec.ckpt.format.dense_optim import by_fqn, from_fqn, load_named_state, named_state
from cnr_torchrec.ckpt.format.manifest import (committed_ids, existing_dir_ids, load_manifest, manifest_path, seal,
                                               write_index)
from cnr_torchrec.ckpt.format.payload import unflatten_state
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.ckpt.save.catalog import remove_partial
from cnr_torchrec.ckpt.save.commit import manifest_body
from cnr_torchrec.ckpt.save.merge import regions_of_layout
from cnr_torchrec.ckpt.save.planner import Decision
from cnr_torchrec.ckpt.save.staging import Staged, StagedShard
from cnr_torchrec.ckpt.save.writer import write_rank
from cnr_torchrec.ckpt.tools.offline import Progress, TableData, assemble_tables, load_chain, resolve_id
from cnr_torchrec.errors import (CheckpointNotFoundError, CnrError, ConfigError, CorruptCheckpointError,
                                 IncompatibleCheckpointError, UnsafeCheckpointError)
from cnr_torchrec.quant import get_codec

__all__ = ["MODEL", "OPTIM", "DENSE_OPTIM", "DMPLoadPlanner", "dense_optimizer_state_dict", "export_dcp", "import_dcp",
           "load_dense_optimizer"]

log = logging.getLogger(__name__)

MODEL, OPTIM, DENSE_OPTIM = "model", "optim", "dense_optim"
"""The top-level keys: ``dmp.state_dict()``, ``dmp.fused_optimizer.state_dict()``, the dense optimizer."""


def _column_shards(boxes: Sequence[tuple[Any, Any]], rows: int, dim: int, k: int, what: str) -> list[tuple[int, int]]:
    """The column ranges of the ``k`` column shards of a weight whose shards (offsets, sizes) are ``boxes``, in
    column order (TorchRec's order of row-wise state). IncompatibleCheckpointError for other layouts."""
    if k == 1:
        return [(0, dim)]
    cols = sorted({(int(o[1]), int(o[1]) + int(s[1])) for o, s in boxes})
    if len(cols) != k or any(int(o[0]) != 0 or int(s[0]) != rows for o, s in boxes):
        raise IncompatibleCheckpointError(f"{what}: row-wise state of {k} column shards, but the weight's shards are "
                                          f"{[(list(o), list(s)) for o, s in boxes]}; only column-wise layouts (every "
                                          "shard spanning all rows) split row-wise state by columns")
    return cols


# ---------------------------------------------------------------------- export


@dataclass(frozen=True)
class _Piece:
    """One DCP chunk of the export: its tensor's DCP path and size, its offsets and sizes there, and the block
    of the assembled table it holds (``what``: ``weight``, element-wise ``state`` or ``rowwise`` state)."""

    path: tuple[str, ...]
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    table: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    what: str = "weight"

    def take(self, data: TableData) -> torch.Tensor:
        (r0, r1), (c0, c1) = self.rows, self.cols
        if self.what == "rowwise":
            return data.states[0].for_shard(self.rows, self.cols)
        return (data.weights if self.what == "weight" else data.states[0].values)[r0:r1, c0:c1]


def _pieces(tip: Mapping[str, Any], table: str, blocks: list[tuple[tuple[int, int], ...]]) -> list[_Piece]:
    """The weight of ``table`` in the tip's shard ``blocks``, and its fused optimizer state in TorchRec's layout."""
    rows, dim = (int(v) for v in tip["tables"][table])
    fqn = tip.get("table_fqns", {}).get(table, f"{table}.weight")
    weight = [_Piece((MODEL, fqn), (rows, dim), (r[0], c[0]), (r[1] - r[0], c[1] - c[0]), table, r, c)
              for r, c in blocks]
    states = [e.get("states", []) for r in tip["ranks"] for e in r["tables"].get(table, [])]
    count = max(map(len, states), default=0)
    if count == 0:  # replicated (data_parallel) tables, and fused optimizers without state (SGD)
        return weight
    if count > 1:
        raise IncompatibleCheckpointError(
            f"table '{table}' stores {count} optimizer states per row; a DCP export names one, TorchRec's "
            "'momentum1' (the row-wise or element-wise Adagrad sum). Export it with --format torch")
    path = (OPTIM, "state", fqn, f"{table}.momentum1")
    if not any(s[0]["rowwise"] for s in states if s):
        return weight + [dataclasses.replace(p, path=path, what="state") for p in weight]
    if all(c == (0, dim) for _, c in blocks):  # table-wise, row-wise: [rows], a chunk per shard
        state = [_Piece(path, (rows,), (r[0],), (r[1] - r[0],), table, r, (0, dim), "rowwise") for r, _ in blocks]
    elif all(r == (0, rows) for r, _ in blocks):  # column-wise: [k * rows], shard after shard in column order
        cols = sorted(c for _, c in blocks)
        state = [_Piece(path, (rows * len(cols),), (i * rows,), (rows,), table, (0, rows), c, "rowwise")
                 for i, c in enumerate(cols)]
    else:  # split both ways: the per-row mean, [rows]
        state = [_Piece(path, (rows,), (0,), (rows,), table, (0, rows), (0, dim), "rowwise")]
    return weight + state


class _ExportPlanner(DefaultSavePlanner):
    """The plan of the dense state (given to ``dcp.save``) plus every table's chunks, in table order, so that one
    table is assembled and held at a time. ``decoded`` counts the assemblies."""

    def __init__(self, storage: Storage, chain: list[dict[str, Any]], pieces: list[_Piece],
                 progress: Progress | None) -> None:
        super().__init__()
        self._storage, self._chain, self._progress = storage, chain, progress
        self._pieces = {(".".join(p.path), p.offsets): p for p in pieces}  # by DCP's flat key and offsets
        self._held: tuple[str, TableData] | None = None
        self.decoded = 0

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        paths = {fqn: p.path for (fqn, _), p in self._pieces.items()}
        if set(paths) & set(self.mappings):
            raise CorruptCheckpointError(f"dense state {sorted(set(paths) & set(self.mappings))} is named as a table")
        self.mappings.update(paths)  # becomes metadata.planner_data

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)),
                                                       TensorProperties(dtype=torch.float32), torch.Size(p.size)))
                 for (fqn, _), p in self._pieces.items()]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        p = self._pieces.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if p is None:
            return super().resolve_data(write_item)
        if self._held is None or self._held[0] != p.table:
            self._held = None  # the previous table goes before the next is assembled
            tables = assemble_tables(self._storage, self._chain, self._progress, tables=[p.table])
            self._held, self.decoded = (p.table, tables[p.table]), self.decoded + 1
        return p.take(self._held[1])


def export_dcp(storage: Storage, out: str, ckpt_id: int | None = None,
               progress: Progress | None = None) -> dict[str, Any]:
    """Writes checkpoint ``ckpt_id`` (default: the newest committed) as a DCP checkpoint in new directory ``out``:
    float32 tables, decoded one at a time once the chain verifies. Runs in this process alone.

    Returns:
        ``{"id", "step", "tensors", "nbytes", "tables_decoded"}`` (table assemblies: one per table).

    Raises:
        ConfigError: ``out`` exists.
        CheckpointNotFoundError: nothing committed, or ``ckpt_id`` is not committed.
        CorruptCheckpointError: a file of the chain fails its checks (names it).
        IncompatibleCheckpointError: a table stores more than one optimizer state per row.
    """
    out = os.path.abspath(out)
    if os.path.lexists(out):
        raise ConfigError(f"{out} exists; give --out a new directory (an export never overwrites)")
    chain = load_chain(storage, resolve_id(storage, ckpt_id))
    tip = chain[-1]
    blocks: dict[str, list[tuple[tuple[int, int], ...]]] = {}  # the tip's shards: (rows, cols)
    for g in (g for regions in regions_of_layout(tip).values() for g in regions if g.rows[1] > g.rows[0]):
        blocks.setdefault(g.table, []).append((g.rows, g.cols))
    pieces = [p for t in sorted(tip["tables"]) for p in _pieces(tip, t, sorted(blocks.get(t, [])))]
    first = next(r for r in tip["ranks"] if r["rank"] == 0)
    load = PayloadReader(storage, first, whole=False)  # the dense state: a few blobs of rank 0's file
    dense: dict[str, Any] = {MODEL: {name: load(blob) for name, blob in first["dense"].items()}}
    named = unflatten_state(first.get("dense_optimizer"), load)
    if named is not None and "param_names" in named:  # by parameter name (an older build's is by position only)
        dense[DENSE_OPTIM] = by_fqn(named)
    planner, tmp = _ExportPlanner(storage, chain, pieces, progress), f"{out}.tmp-{os.getpid()}"
    try:
        writer = FileSystemWriter(tmp, single_file_per_rank=False, overwrite=False)
        md = _dcp_call(dcp.save, dense, storage_writer=writer, planner=planner, no_dist=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tensors = [m for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
    return {"id": tip["id"], "step": tip["step"], "tensors": len(tensors), "tables_decoded": planner.decoded,
            "nbytes": sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors)}


# ---------------------------------------------------------------------- reading and loading DCP checkpoints


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
        targets, spans = [], {}
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
                merged = sum(v.double() * w for v, (_, w) in zip(vals, weights)) / sum(w for _, w in weights)
            with torch.no_grad():
                live.copy_(merged)


class DMPLoadPlanner(DefaultLoadPlanner):
    """``dcp.load(state_dict, checkpoint_id=..., planner=DMPLoadPlanner())`` into a DMP of any plan.

    On top of DefaultLoadPlanner (weights reshard by FQN), for the module's layout: (1) row-wise fused state
    whose column shards differ from the saved ones is read per saved column shard and put on each local shard
    by column overlap: a shard inside one saved shard takes its value, one spanning several their column-width-
    weighted mean, as ``Checkpointer.restore`` does; (2) optimizer state (``optim``, ``dense_optim``) the
    checkpoint lacks stays as it is, listed in ``skipped``; (3) other values load with ``weights_only=True``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[str] = []
        self._remaps: dict[str, _Remap] = {}
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
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
        md = self.metadata.state_dict_metadata
        saved = md.get(fqn)
        if not (len(path) == 4 and path[:2] == (OPTIM, "state") and isinstance(live, ShardedTensor)
                and live.dim() == 1 and isinstance(saved, TensorStorageMetadata) and len(saved.size) == 1):
            return None
        wkey = f"{MODEL}.{path[2]}"
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


def dense_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The dense optimizer's state by parameter FQN (positions change with the plan; torch's
    ``get_optimizer_state_dict`` does not take a DMP), to save under ``dense_optim``.

    Raises:
        ConfigError: the optimizer holds a parameter that is not the model's.
    """
    return by_fqn(named_state(model, optimizer))


def load_dense_optimizer(checkpoint_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Loads ``dense_optim`` of the DCP checkpoint in ``checkpoint_id`` into ``optimizer`` by parameter name, as
    a restore does: every rank reads it whole; a parameter without saved state keeps a fresh one (logged).

    Raises:
        CheckpointNotFoundError: no DCP checkpoint there, or one without ``dense_optim``.
        IncompatibleCheckpointError: a parameter's state has another shape, or ``dense_optim`` is malformed.
    """
    tree = _read_tree(checkpoint_id, _metadata(checkpoint_id), DENSE_OPTIM)
    if tree is None:
        raise CheckpointNotFoundError(f"{checkpoint_id} holds no '{DENSE_OPTIM}'; leave the dense optimizer fresh")
    where = f"DCP checkpoint {checkpoint_id}: '{DENSE_OPTIM}'"
    load_named_state(model, optimizer, from_fqn(tree, where), where)


# ---------------------------------------------------------------------- import


_TABLE_FQN = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.([^.]+)\.weight$")


class _DcpTable(NamedTuple):
    name: str
    fqn: str
    shape: tuple[int, int]
    state: str | None  # flat key of its fused optimizer state


def _fp32(md: Metadata, key: str, where: str) -> TensorStorageMetadata:
    """The metadata of tensor ``key``; IncompatibleCheckpointError unless it is float32."""
    m = md.state_dict_metadata[key]
    if not isinstance(m, TensorStorageMetadata) or m.properties.dtype != torch.float32:
        raise IncompatibleCheckpointError(f"{where}: {key} is {getattr(m, 'properties', m)}; tables and their "
                                          "optimizer state are imported from float32 only (cast them before dcp.save)")
    return m


def _dcp_tables(md: Metadata, where: str) -> dict[str, _DcpTable]:
    """The tables: ``model`` weights with fused state under ``optim``, and those named like TorchRec's
    (``...embedding_bags.<table>.weight``, ``...embeddings.<table>.weight``). Checks dtypes and shapes."""
    paths = {k: _path(md, k) for k in md.state_dict_metadata}
    fused: dict[str, dict[str, str]] = {}
    for key, p in paths.items():
        if len(p) == 4 and p[:2] == (OPTIM, "state"):
            fused.setdefault(str(p[2]), {})[str(p[3])] = key
    out: dict[str, _DcpTable] = {}
    for key, p in sorted(paths.items()):
        if len(p) != 2 or p[0] != MODEL:
            continue
        fqn, states, m = str(p[1]), fused.pop(str(p[1]), {}), _TABLE_FQN.search(str(p[1]))
        if not states and m is None:
            continue  # a dense parameter or buffer
        name = m.group(1) if m else next(iter(states)).rsplit(".", 1)[0]
        if set(states) - {f"{name}.momentum1"} or name in out:
            raise IncompatibleCheckpointError(
                f"{where}: '{OPTIM}' holds {sorted(states)} for {fqn}; a table has one state, '<table>.momentum1' (the "
                f"row-wise or element-wise Adagrad sum), and a unique name. Save a dense optimizer as '{DENSE_OPTIM}'")
        weight = _fp32(md, key, where)
        if len(weight.size) != 2:
            raise IncompatibleCheckpointError(f"{where}: {key} is {list(weight.size)}, not [rows, dim]")
        rows, dim = (int(v) for v in weight.size)
        state = next(iter(states.values()), None)
        size = None if state is None else list(_fp32(md, state, where).size)
        if size is not None and size != [rows, dim] and not (len(size) == 1 and rows and size[0] % rows == 0):
            raise IncompatibleCheckpointError(f"{where}: {state} is {size}; for a table of {rows} x {dim} it must be "
                                              f"[{rows}, {dim}] or [k * {rows}] (k column shards)")
        out[name] = _DcpTable(name, fqn, (rows, dim), state)
    if fused:
        raise IncompatibleCheckpointError(f"{where}: it holds fused optimizer state of {sorted(fused)} but not their "
                                          f"weights under '{MODEL}': it lacks those tables")
    if not out:
        raise IncompatibleCheckpointError(f"{where}: no embedding table under '{MODEL}'; dcp.save {{'{MODEL}': "
                                          f"dmp.state_dict(), '{OPTIM}': dmp.fused_optimizer.state_dict()}}")
    return out


def _table_shards(path: str, md: Metadata, tables: dict[str, _DcpTable],
                  progress: Progress | None) -> Iterator[StagedShard]:
    """Each table as entries of whole rows, read one table at a time: one entry, or one per column shard when
    its row-wise state was saved per column shard (each keeps its own value)."""
    for t in sorted(tables.values(), key=lambda t: t.name):
        (rows, dim), wkey = t.shape, f"{MODEL}.{t.fqn}"
        got = _read(path, {wkey: torch.empty(rows, dim),
                           **({} if t.state is None else {t.state: _empty(md.state_dict_metadata[t.state])})})
        weights, state = got[wkey], got.get(t.state)
        if state is None or state.dim() == 2:
            states = [] if state is None else [(state, False)]
            yield StagedShard(t.name, (0, rows), (0, dim), "full", None, weights, states)
        else:
            chunks = [(c.offsets, c.sizes) for c in md.state_dict_metadata[wkey].chunks]
            for i, (c0, c1) in enumerate(_column_shards(chunks, rows, dim, state.numel() // rows, wkey)):
                yield StagedShard(t.name, (0, rows), (c0, c1), "full", None, weights[:, c0:c1].contiguous(),
                                  [(state[i * rows: (i + 1) * rows], True)])
        if progress is not None:
            progress(1)


def _dense(path: str, md: Metadata, tables: dict[str, _DcpTable]) -> dict[str, torch.Tensor]:
    """The dense parameters and buffers: every ``model`` entry that is not a table."""
    taken = {t.fqn for t in tables.values()}
    keys = {k: str(p[1]) for k in md.state_dict_metadata
            if len(p := _path(md, k)) == 2 and p[0] == MODEL and str(p[1]) not in taken}
    for k in keys:  # (a dtype our payloads do not store fails when it is written)
        if not isinstance(md.state_dict_metadata[k], TensorStorageMetadata):
            raise IncompatibleCheckpointError(f"{path}: {k} is not a tensor; every '{MODEL}' entry must be one")
    return {keys[k]: v for k, v in _read(path, {k: _empty(md.state_dict_metadata[k]) for k in keys}).items()}


def import_dcp(path: str, storage: Storage, *, append: bool = False, step: int = 0,
               progress: Progress | None = None) -> dict[str, Any]:
    """Writes the DCP checkpoint in directory ``path`` (the module's layout, as ``dcp.save({"model":
    dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict(), "dense_optim": ...})`` wrote it) as a baseline
    of ``storage`` with the next free id: full-precision entries, one table read at a time. A failure before
    the commit (the sealed manifest) removes what was written.

    Args:
        append: import into a root that holds checkpoints, as a new baseline with the newest one's tables.
        step: the training step the baseline records.

    Returns:
        The new checkpoint's manifest body.

    Raises:
        CheckpointNotFoundError: ``path`` holds no DCP checkpoint.
        ConfigError: the root holds checkpoints and ``append`` is False.
        IncompatibleCheckpointError: a table (or its weight) is missing, a shape differs (from the root's, or
            between a table and its state), a table or its state is not float32, or the layout is another.
        UnsafeCheckpointError, CorruptCheckpointError: its metadata pickles what DCP never writes, or does not load.
    """
    md = _metadata(path)
    tables = _dcp_tables(md, path)
    committed = committed_ids(storage)
    if committed and not append:
        raise ConfigError(f"{storage.root} already holds checkpoints (newest: {committed[-1]}); import into an empty "
                          "root, or pass --append (append=True) to add the import as a new baseline")
    if committed:  # the newest checkpoint's tables, shapes included
        have = {t: [int(v) for v in shape] for t, shape in load_manifest(storage, committed[-1])["tables"].items()}
        got = {t.name: list(t.shape) for t in tables.values()}
        problems = [f"table '{t}' is {got.get(t, 'missing')} there and {have.get(t, 'missing')} in checkpoint "
                    f"{committed[-1]}" for t in sorted(set(have) | set(got)) if have.get(t) != got.get(t)]
        if problems:
            raise IncompatibleCheckpointError(f"{path} is not of the model of {storage.root}: {'; '.join(problems)}. "
                                              "Import it into a new root")
    tree = _read_tree(path, md, DENSE_OPTIM)
    new_id = max(existing_dir_ids(storage) + committed, default=-1) + 1
    decision = Decision(new_id, step, "baseline", None, None, (new_id,), {t: "full" for t in tables},
                        f"imported from DCP checkpoint {path}")
    staged = Staged(decision, 0, 1, shards=_table_shards(path, md, tables, progress), dense=_dense(path, md, tables),
                    dense_optimizer=None if tree is None else from_fqn(tree, f"{path}: '{DENSE_OPTIM}'"),
                    table_shapes={t.name: list(t.shape) for t in tables.values()})
    codec, t0 = get_codec("none"), time.perf_counter()
    try:
        report = write_rank(staged, codec, storage, chunk_bytes=DEFAULT_CHUNK_BYTES)  # consumes the shards lazily
        report["write_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        fields = {"policy": None, "world_size": 1, "restores": 0,
                  "table_fqns": {t.name: t.fqn for t in tables.values()},
                  "codec": {"method": "none", "bits": codec.bits, "bits_setting": None, "params": codec.params}}
        body = {**manifest_body(decision, [report], fields, [t.name for t in tables.values()]), "per_rank_state": False}
        storage.write_atomic(manifest_path(new_id), seal(body))
    except BaseException:
        remove_partial(storage, new_id, 0)
        raise
    write_index(storage, committed_ids(storage))
    return body
