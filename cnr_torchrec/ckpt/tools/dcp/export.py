"""``cnr export --format dcp``: a chain written as the chunks of its tip's shard layout, streamed table by table."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from cnr_torchrec.ckpt.format.blocks import regions_of_layout
from cnr_torchrec.ckpt.format.bytes.chunks import PayloadReader
from cnr_torchrec.ckpt.format.bytes.payload import unflatten_state
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.tables import Progress, TableData, assemble_tables
from cnr_torchrec.ckpt.live.dense_optim import SavedDenseOptimizer
from cnr_torchrec.ckpt.tools.checked_chain import load_chain
from cnr_torchrec.ckpt.tools.dcp.dmp_keys import DENSE_OPTIM, OPTIM, TRAIN_STATE, check_model_keys
from cnr_torchrec.ckpt.tools.dcp.load import _dcp_call
from cnr_torchrec.ckpt.tools.dcp.mc import SEGMENTS, buffer_of, mc_prefix
from cnr_torchrec.ckpt.tools.root import resolve_id
from cnr_torchrec.errors import ConfigError, CorruptCheckpointError, IncompatibleCheckpointError
from cnr_torchrec.track.managed_collision import sort_order

__all__ = ["export_dcp"]

log = logging.getLogger(__name__)


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
    dtype: torch.dtype = torch.float32

    def take(self, data: TableData) -> torch.Tensor:
        (r0, r1), (c0, c1) = self.rows, self.cols
        if self.what == "rowwise":
            return data.states[0].for_shard(self.rows, self.cols)
        if self.what.startswith("mc:"):
            return _mc_buffer(data, self.rows, self.what.removeprefix("mc:"))
        return (data.weights if self.what == "weight" else data.states[0].values)[r0:r1, c0:c1]


def _mc_buffer(data: TableData, rows: tuple[int, int], field: str) -> torch.Tensor:
    """A managed-collision buffer of the module that holds slots ``rows``, as it keeps it: by sort position
    (raw ids ascending, empty slots after them in row order), from the table's by-row state."""
    if data.mc is None:
        raise CorruptCheckpointError(f"the chain stores no managed-collision state for rows {rows}")
    state = data.mc[rows[0] : rows[1]]
    order = sort_order(state)
    if field == "mapping":
        return order + rows[0]
    return state[order, data.mc_fields.index(field)].contiguous()


def _mc_pieces(tip: Manifest, table: str, blocks: list[tuple[tuple[int, int], ...]]) -> list[_Piece]:
    """A sort-zch table's remapping buffers, as the sharded module's state_dict names and shards them: one
    chunk per rank's slots of ``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping`` and the policy's metadata."""
    fields = next((e.mc.fields for r in tip.ranks for e in r.tables.get(table, ()) if e.mc is not None), None)
    if fields is None:
        return []
    prefix = _mc_prefix(tip, table)
    rows = tip.tables[table][0]
    return [_Piece((f"{prefix}.{buffer_of(field)}",), (rows,), (r[0],), (r[1] - r[0],), table, r, c,
                   f"mc:{field}", torch.int64)
            for field in (*fields, "mapping") for r, c in blocks]


def _mc_prefix(tip: Manifest, table: str) -> str:
    """The table's managed-collision module's name, from its weight's
    (``<module>._embedding_module.<embedding_bags|embeddings>.<table>.weight``)."""
    fqn = tip.table_fqns.get(table, "")
    module, sep, _ = fqn.partition("._embedding_module.")
    if not sep:
        raise IncompatibleCheckpointError(
            f"table '{table}' stores managed-collision state, but its weight is named {fqn!r}, not as a "
            "ManagedCollision(EmbeddingBag|Embedding)Collection's; export it with --format torch")
    return mc_prefix(module, table)


def _mc_plain_buffers(tip: Manifest, load: PayloadReader, pieces: list[_Piece]) -> dict[str, torch.Tensor]:
    """The managed-collision buffers every rank keeps whole: ``_current_iter_tensor`` (the step count, from
    rank 0's saved counters) and ``_output_segments_tensor`` (the first slot of each rank, then the table's
    rows, padded with -1 to TorchRec's 1025)."""
    first = tip.ranks[0]
    out = {}
    for table in sorted({p.table for p in pieces if p.what.startswith("mc:")}):
        prefix = _mc_prefix(tip, table)
        starts = sorted({p.rows[0] for p in pieces if p.table == table and p.what == "mc:raw_id"})
        segments = starts + [tip.tables[table][0]]
        out[f"{prefix}._output_segments_tensor"] = torch.tensor(segments + [-1] * (SEGMENTS - len(segments)))
        runtime = unflatten_state(first.mc_runtime[table], load) if table in first.mc_runtime else None
        if runtime is None:
            raise CorruptCheckpointError(f"{first.file} holds no counters of managed-collision table '{table}'",
                                         path=first.file)
        out[f"{prefix}._current_iter_tensor"] = torch.tensor([int(runtime["iter_tensor"])])
    return out


def _pieces(tip: Manifest, table: str, blocks: list[tuple[tuple[int, int], ...]]) -> list[_Piece]:
    """The weight of ``table`` in the tip's shard ``blocks``, and its fused optimizer state in TorchRec's layout."""
    rows, dim = tip.tables[table]
    fqn = tip.table_fqns.get(table, f"{table}.weight")
    weight = [_Piece((fqn,), (rows, dim), (r[0], c[0]), (r[1] - r[0], c[1] - c[0]), table, r, c)
              for r, c in blocks]
    states = [e.states for r in tip.ranks for e in r.tables.get(table, ())]
    count = max(map(len, states), default=0)
    if count == 0:  # replicated (data_parallel) tables, and fused optimizers without state (SGD)
        return weight
    if count > 1:
        raise IncompatibleCheckpointError(
            f"table '{table}' stores {count} optimizer states per row; a DCP export names one, TorchRec's "
            "'momentum1' (the row-wise or element-wise Adagrad sum). Export it with --format torch")
    path = (OPTIM, "state", fqn, f"{table}.momentum1")
    if not any(s[0].rowwise for s in states if s):
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

    def __init__(self, storage: Storage, chain: list[Manifest], pieces: list[_Piece],
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
                                                       TensorProperties(dtype=p.dtype), torch.Size(p.size)))
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


def _dense_optim(saved: Any, where: str) -> dict[str, Any] | None:
    """The ``dense_optim`` entry of an export, by parameter name: the torch.optim form remapped from positions,
    a TorchRec keyed optimizer's state as it saved it (already by name); None, logged, for state of no names
    (an opaque optimizer's, or one an older build kept by position only), which DCP could not load by name."""
    if saved is None:
        return None
    record = SavedDenseOptimizer.from_tree(saved, where)
    out = record.by_fqn()
    if out is None:
        log.warning("%s: the dense optimizer state (%s) is not keyed by parameter name; the export leaves it "
                    "out of '%s'", where, record.label(), DENSE_OPTIM)
    return out


def export_dcp(storage: Storage, out: str, ckpt_id: int | None = None,
               progress: Progress | None = None) -> dict[str, Any]:
    """Writes checkpoint ``ckpt_id`` (default: the newest committed) as a DCP checkpoint in new directory ``out``:
    the model's keys at the top level (float32 tables, decoded one at a time once the chain verifies), the fused
    optimizer under ``optim``, the dense one under ``dense_optim`` and the step under ``train_state``
    (docs/dcp.md). Runs in this process alone.

    Returns:
        ``{"id", "step", "tensors", "nbytes", "tables_decoded"}`` (table assemblies: one per table).

    Raises:
        ConfigError: ``out`` exists.
        CheckpointNotFoundError: nothing committed, or ``ckpt_id`` is not committed.
        CorruptCheckpointError: a file of the chain fails its checks (names it).
        IncompatibleCheckpointError: a table stores more than one optimizer state per row, or a model key is
            (or begins with) a top-level name of the layout (``layout.RESERVED``).
    """
    out = os.path.abspath(out)
    if os.path.lexists(out):
        raise ConfigError(f"{out} exists; give --out a new directory (an export never overwrites)")
    chain = load_chain(storage, resolve_id(storage, ckpt_id))
    tip = chain[-1]
    blocks: dict[str, list[tuple[tuple[int, int], ...]]] = {}  # the tip's shards: (rows, cols)
    for g in (g for regions in regions_of_layout(tip).values() for g in regions if g.rows[1] > g.rows[0]):
        blocks.setdefault(g.table, []).append((g.rows, g.cols))
    pieces = [p for t in sorted(tip.tables) for p in (_pieces(tip, t, sorted(blocks.get(t, [])))
                                                       + _mc_pieces(tip, t, sorted(blocks.get(t, []))))]
    first = tip.ranks[0]
    load = PayloadReader(storage, first.payload, whole=False)  # the dense state: a few blobs of rank 0's file
    dense: dict[str, Any] = {name: load(blob) for name, blob in first.dense.items()}  # the model's, top level
    dense.update(_mc_plain_buffers(tip, load, pieces))
    check_model_keys([*dense, *(p.path[0] for p in pieces if p.path[0] != OPTIM)], f"checkpoint {tip.id}")
    dense[TRAIN_STATE] = {"step": tip.step}
    dense_optim = _dense_optim(unflatten_state(first.dense_optimizer, load), f"checkpoint {tip.id}")
    if dense_optim is not None:
        dense[DENSE_OPTIM] = dense_optim
    planner, tmp = _ExportPlanner(storage, chain, pieces, progress), f"{out}.tmp-{os.getpid()}"
    try:
        writer = FileSystemWriter(tmp, single_file_per_rank=False, overwrite=False)
        md = _dcp_call(dcp.save, dense, storage_writer=writer, planner=planner, no_dist=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tensors = [m for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
    return {"id": tip.id, "step": tip.step, "tensors": len(tensors), "tables_decoded": planner.decoded,
            "nbytes": sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors)}

