"""Saving, in two halves: ``stage`` (blocking, on the training thread) and ``write_rank`` (background).

``stage`` copies what the decision asks for into host memory that training will not
touch again: dirty weight and optimizer-state rows of every local shard, and on rank 0
the replicated state (data_parallel tables, dense parameters, the dense optimizer). It
is the only part of a save that stalls training besides the planner's all-gather.
``write_rank`` encodes the staged rows with the codec and writes one payload file per
rank; it returns the rank's report, which rank 0 folds into the manifest.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from cnr_torchrec.ckpt.config import BudgetConfig
from cnr_torchrec.ckpt.dense_optim import named_state
from cnr_torchrec.ckpt.manifest import rank_file
from cnr_torchrec import ops
from cnr_torchrec.ckpt.payload import BlobWriter, checksum, flatten_state
from cnr_torchrec.ckpt.planner import Decision
from cnr_torchrec.ckpt.priority import choose_rows, gather_column_counts
from cnr_torchrec.ckpt.storage import Storage
from cnr_torchrec.track._tbe_cache import flush_caches
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.quant import Codec
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["Staged", "StagedShard", "dense_named_state", "stage", "write_rank", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)


@dataclass
class StagedShard:
    """Rows of one local shard, copied to host.

    ``ids`` are offsets into the shard (None when the shard is written whole).
    ``states`` are the fused optimizer's per-row states, each with a flag saying whether
    it holds one value per row (rowwise) or one per column.
    """

    table: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    encoding: str
    ids: torch.Tensor | None
    weights: torch.Tensor
    states: list[tuple[torch.Tensor, bool]]


@dataclass
class Staged:
    decision: Decision
    rank: int
    world_size: int
    shards: list[StagedShard] = field(default_factory=list)
    replicated_tables: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    dense_optimizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    rng: Any = None
    tbe_iter: int = 0
    table_shapes: dict[str, list[int]] = field(default_factory=dict)
    stall_ms: float = 0.0
    # Per table, global rows a budget-limited delta left out: they stay dirty for a later save.
    left_out: dict[str, torch.Tensor] = field(default_factory=dict)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` that owns its memory (pinned when ``t`` is on an accelerator)."""
    if t.device.type == "cpu":
        return t.detach().clone(memory_format=torch.contiguous_format)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    return out


def _gather_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``t`` in host memory: one gather on the host, a gather then a pinned copy elsewhere."""
    picked = t.detach().index_select(0, rows)  # a new tensor that training never writes
    return picked if picked.device.type == "cpu" else _host_copy(picked)


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def dense_named_state(model: nn.Module, tracker: DirtyRowTracker) -> dict[str, torch.Tensor]:
    """Parameters and buffers outside the sharded embedding modules (replicated by DDP), by name."""
    sharded = set(tracker.module_fqns())
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        clean = name.removeprefix("module.").replace("._orig_mod", "")
        if any(clean == m or clean.startswith(m + ".") for m in sharded):
            continue
        out[clean] = t
    return out


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, Python, NumPy) as tensors and JSON-able values."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["name"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], nps["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def stage(
    decision: Decision,
    *,
    model: nn.Module,
    tracker: DirtyRowTracker,
    rank: int,
    world_size: int,
    dense_optimizer: Any,
    extra_state: dict[str, Any],
    budget: BudgetConfig | None = None,
) -> Staged:
    """Copies everything ``decision`` saves into host memory. Blocks training.

    With ``budget.max_rows_fraction`` set, a delta writes at most
    ``ceil(max_rows_fraction * rows)`` rows of each shard: the dirty rows with the highest
    lookup counts (CPR's MFU/SSU), as ids even where the decision said ``full``. The
    rows left out are returned in ``Staged.left_out`` and must stay dirty
    (``tracker.reset(keep=staged.left_out)``). Baselines are never limited. With SSU and
    column-split tables on several ranks this is collective (every rank calls it).

    Raises:
        ConfigError: a budget on a one-shot delta (restored from the baseline and the latest
            delta alone, a row left out would fall back to its baseline value).
    """
    t0 = time.perf_counter()
    out = Staged(decision, rank, world_size)
    since_baseline = decision.since == "baseline"
    limited = budget is not None and budget.max_rows_fraction is not None and decision.kind == "delta"
    if limited and since_baseline:
        raise ConfigError(
            "budget.max_rows_fraction needs policy consecutive: a one-shot delta is restored from the baseline "
            "and the latest delta alone, so rows a budget left out would lose their saved updates"
        )
    column_counts = gather_column_counts(tracker, budget.priority, world_size) if limited else {}
    flush_caches(tracker.tbes())  # fused_uvm_caching: rows updated in the cache, written back before any read
    dirty_total = left_total = 0
    tbe_iters = []
    for table in tracker.tables():
        shape = tracker.table_shape(table)
        if shape is not None:
            out.table_shapes[table] = list(shape)
        if tracker.is_data_parallel(table):
            if rank == 0:
                (kernel, shard), *_ = tracker.shards(table)
                out.replicated_tables[table] = _host_copy(kernel.tbe.split_embedding_weights()[shard.local_index])
            continue
        encoding = decision.encodings.get(table, "full")
        shard_dirty = tracker.shard_dirty_rows(table, since_baseline=since_baseline)
        chosen: dict[tuple[int, int], torch.Tensor] = {}
        if limited:
            chosen, left_out = choose_rows(tracker, table, shard_dirty, budget.max_rows_fraction,
                                           column_counts.get(table))
            if left_out.numel():
                out.left_out[table] = left_out
            dirty_total += sum(int(d.numel()) for d in {s.rows: d for _, s, d in shard_dirty}.values())
            left_total += int(left_out.numel())
        for kernel, shard, dirty in shard_dirty:
            weights = kernel.tbe.split_embedding_weights()[shard.local_index]
            all_states = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
            states = list(all_states[shard.local_index]) if all_states else []
            shard_encoding = encoding
            if shard.rows in chosen:  # the budget is smaller than the shard: selected rows, with ids
                shard_encoding, dirty = "rows", chosen[shard.rows]
            if shard_encoding == "full":
                ids, rows = None, None
            else:
                ids = dirty
                rows = dirty.to(weights.device)
            pick = _host_copy if rows is None else (lambda t, rows=rows: _gather_rows(t, rows))
            staged_states = []
            for s in states:
                rowwise = s.dim() == 1 or s.numel() == shard.num_rows
                s2 = s.reshape(shard.num_rows) if rowwise else s.reshape(shard.num_rows, -1)
                staged_states.append((pick(s2), rowwise))
            out.shards.append(
                StagedShard(table, shard.rows, shard.cols, shard_encoding, ids, pick(weights), staged_states)
            )
    for tbe in tracker.tbes():
        it = getattr(tbe, "iter", None)
        if isinstance(it, torch.Tensor) and it.numel() == 1:
            tbe_iters.append(int(it.item()))
    out.tbe_iter = max(tbe_iters, default=0)
    if rank == 0:
        out.dense = {n: _host_copy(t) for n, t in dense_named_state(model, tracker).items()}
        if dense_optimizer is not None:
            out.dense_optimizer = _clone_tree(named_state(model, dense_optimizer))
    out.extra = {name: _clone_tree(obj.state_dict()) for name, obj in extra_state.items()}
    out.rng = _clone_tree(rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the pinned copies above were asynchronous
    out.stall_ms = (time.perf_counter() - t0) * 1e3
    if limited:
        log.info("budget-limited delta %d (%s, max_rows_fraction %s): %d of %d dirty rows written, %d left dirty",
                 decision.ckpt_id, budget.priority, budget.max_rows_fraction, dirty_total - left_total, dirty_total,
                 left_total)
    return out


def _encode_ids(ids: torch.Tensor, num_rows: int) -> tuple[str, torch.Tensor]:
    """Row offsets as a bitmap (1 bit per shard row) or a list (4 bytes per dirty row), whichever is smaller."""
    if num_rows <= 32 * ids.numel():
        mask = np.zeros(num_rows, dtype=bool)
        mask[ids.numpy()] = True
        return "bitmap", torch.from_numpy(np.packbits(mask, bitorder="little"))
    return "list", ids.to(torch.int32)


def decode_ids(kind: str, blob: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`_encode_ids`: sorted int64 row offsets."""
    if kind == "bitmap":
        # LSB-first bytes are LSB-first int64 words on a little-endian host: the tracker's own bitmap layout.
        nbytes = (num_rows + 7) // 8
        words = torch.zeros(ops.bitmap_words(num_rows) * 8, dtype=torch.uint8)
        k = min(nbytes, blob.numel())  # a short blob decodes to fewer ids, which the caller's count check catches
        words[:k] = blob.reshape(-1)[:k]
        return ops.bitmap_to_rows(words.view(torch.int64), 0, num_rows)
    if kind == "list":
        return blob.to(torch.int64)
    raise ValueError(f"unknown id encoding {kind!r}")


def write_rank(
    staged: Staged, codec: Codec, storage: Storage, *, state_dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """Encodes and writes this rank's payload file. Returns the rank's report for the manifest.

    Optimizer-state rows are stored as ``state_dtype`` (restore casts them back).
    """
    t0 = time.perf_counter()
    d = staged.decision
    blobs = BlobWriter()
    tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = 0
    for i, s in enumerate(staged.shards):
        prefix = f"s{i}"
        n_rows = s.rows[1] - s.rows[0]
        entry: dict[str, Any] = {"rows": list(s.rows), "cols": list(s.cols), "encoding": s.encoding}
        if s.ids is not None:
            kind, packed = _encode_ids(s.ids, n_rows)
            entry["ids"] = {"kind": kind, "count": int(s.ids.numel()), "blob": blobs.add(f"{prefix}/ids", packed)}
        encoded = codec.encode(s.weights.float())
        entry["weights"] = {
            "meta": encoded.metadata(),
            "blobs": {k: blobs.add(f"{prefix}/w/{k}", v) for k, v in encoded.to_tensors().items()},
        }
        entry["states"] = [
            {"rowwise": rowwise,
             "blob": blobs.add(f"{prefix}/state{j}", t.to(state_dtype) if t.is_floating_point() else t)}
            for j, (t, rowwise) in enumerate(s.states)
        ]
        rows_written += encoded.num_rows
        tables.setdefault(s.table, []).append(entry)
    replicated = {name: blobs.add(f"rep/{name}", t) for name, t in staged.replicated_tables.items()}
    dense = {name: blobs.add(f"dense/{name}", t) for name, t in staged.dense.items()}
    where = f"rank {staged.rank}"
    dense_opt = None
    if staged.dense_optimizer is not None:
        dense_opt = flatten_state(staged.dense_optimizer, "dense_optimizer", blobs, f"{where}: dense_optimizer")
    extra = {n: flatten_state(v, f"extra/{n}", blobs, f"{where}: extra_state[{n!r}]") for n, v in staged.extra.items()}
    rng = flatten_state(staged.rng, "rng", blobs, f"{where}: rng")

    data = blobs.getvalue()
    file = rank_file(d.ckpt_id, staged.rank)
    storage.write(file, data)
    storage.fsync_file(file)
    return {
        "rank": staged.rank,
        "ok": True,
        "file": file,
        "nbytes": len(data),
        "xxh3": checksum(data),
        "blobs": blobs.index,
        "tables": tables,
        "replicated_tables": replicated,
        "dense": dense,
        "dense_optimizer": dense_opt,
        "extra": extra,
        "rng": rng,
        "tbe_iter": staged.tbe_iter,
        "table_shapes": staged.table_shapes,
        "rows_written": rows_written,
        "stall_ms": round(staged.stall_ms, 3),
        "write_ms": round((time.perf_counter() - t0) * 1e3, 3),
    }
