"""Restoring a managed-collision table onto other slot ranges: its rows relocated by raw id.

A sort-zch table's rows belong to raw ids, and TorchRec sends each raw id to the rank of
its input block (:func:`~cnr_torchrec.track.managed_collision.route`, with the live module's
``input_size()`` and ``buckets()``). On another world size (or another split of the rows) an
id's rank and slot change, so its row cannot be restored by global row as other tables' are.
Each rank here:

1. applies the chain to the whole table (:func:`~cnr_torchrec.ckpt.format.tables.assemble_tables`:
   weights, optimizer states and by-row state, exactly as a restore would give them);
2. takes the held raw ids that now route to it. Where they outnumber its slots (all but
   the last, which takes the ids the module misses and is never filled), the module's
   eviction policy keeps the ids it would keep: the most frequent (LFU), the most recent
   (LRU), or the highest count over distance (DistanceLFU); the rest are dropped and counted
   in the log;
3. writes them into its first slots in raw-id order, with their weights, optimizer state and
   metadata; the other slots are empty. The last slot, which every id the module misses reads
   and trains, takes the weights and optimizer state of the saved last slot of the saved rank
   whose rows held its global row (the row itself where that was a last slot too, as a load by
   global row such as TorchRec's own DCP load gives it);
4. takes the eviction window's history of every saved rank, routed by raw id, and the
   iteration counters (equal on every rank).

Every rank reads the whole table: a reshard is rare, and this needs no collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from cnr_torchrec.ckpt.format.bytes.payload import unflatten_state
from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.tables import TableData, assemble_tables
from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.track.managed_collision import EMPTY, McTable, empty_state, route

__all__ = ["ids_for_rank", "needs_relocation", "relocate_tables", "router", "write_rows"]

log = logging.getLogger(__name__)


def needs_relocation(chain: list[Manifest], tracker: DirtyRowTracker, rank: int, world_size: int) -> set[str]:
    """The managed-collision tables of this rank whose slots the chain did not save as they are now: another
    world size, or another row range for this rank in some checkpoint of the chain."""
    out = set()
    for table, mc in tracker.mc_tables().items():
        mine = (mc.start, mc.start + mc.num_rows)
        for m in chain:
            same = m.world_size == world_size and rank < len(m.ranks) and all(
                tuple(e.rows) == mine for e in m.ranks[rank].tables.get(table, ()))
            if not same:
                out.add(table)
    return out


def relocate_tables(tables: set[str], chain: list[Manifest], storage: Storage, tracker: DirtyRowTracker,
                    rank: int, world_size: int) -> None:
    """Restores ``tables`` (managed-collision tables of this rank) from ``chain`` by raw id."""
    if not tables:
        return
    whole = assemble_tables(storage, chain, tables=tables)
    for table in sorted(tables):
        data = whole[table]
        mc = tracker.mc_table(table)
        assert mc is not None  # needs_relocation names managed-collision tables of the model only
        if data.mc is None:
            raise IncompatibleCheckpointError(
                f"table '{table}' is a managed-collision table in the model, a plain one in checkpoint "
                f"{chain[-1].id}; restore it onto the same kind of module")
        if data.mc.shape[1] != len(mc.fields):
            raise IncompatibleCheckpointError(
                f"table '{table}': the checkpoint's managed-collision state has {data.mc.shape[1]} fields, the "
                f"model's module {list(mc.fields)}; restore with the eviction policy it was saved with")
        runtime = _saved_runtime(chain[-1], storage, mc)
        ranks = router(mc, tracker, world_size)
        order = ids_for_rank(table, data, mc, runtime, rank, ranks)
        write_rows(table, data, order, _saved_miss_row(chain[-1], mc), mc, tracker)
        mc.load_runtime(_routed_runtime(runtime, mc, rank, world_size, ranks))


def router(mc: McTable, tracker: DirtyRowTracker, world_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rank of each raw id of ``mc``'s table on this world, as the live module's input distribution sends
    it: by the module's ``input_size()`` and ``buckets()``, and laid out by position where a table that shares
    the distribution (one sharded managed-collision module) has a bucket count that is not a multiple of the
    world size."""
    siblings = [t.mch.buckets() for t in tracker.mc_tables().values() if t.module is mc.module]
    by_position = any(int(b) % world_size for b in siblings)
    buckets = int(mc.mch.buckets())
    return lambda raw_ids: route(raw_ids, mc.input_size, world_size, buckets, by_position=by_position)


def _saved_miss_row(tip: Manifest, mc: McTable) -> int | None:
    """The saved row that this rank's last slot (the one the module gives every id it misses) takes: the last
    row of the saved rank whose rows held that slot's global row; None where no saved rank stored it."""
    last = mc.start + mc.num_rows - 1
    for report in tip.ranks:
        for entry in report.tables.get(mc.table, ()):
            if entry.rows[0] <= last < entry.rows[1]:
                return entry.rows[1] - 1
    return None


def ids_for_rank(table: str, data: TableData, mc: McTable, runtime: list[dict[str, Any]], rank: int,
                       ranks: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The saved rows whose raw ids this rank holds now (``ranks`` routes them), in raw-id order, those the
    policy keeps."""
    assert data.mc is not None  # the caller refused a table saved without its managed-collision state
    raw = data.mc[:, 0]
    held = torch.nonzero(raw != EMPTY).view(-1)
    mine = held[ranks(raw[held]) == rank]
    capacity = mc.num_rows - 1  # the last slot takes the ids the module misses; the module never fills it
    if mine.numel() > capacity:
        current = max((int(r["current_iter"]) for r in runtime), default=0)
        scores = mc.keep_scores(data.mc[mine], current)
        if scores is None:
            raise IncompatibleCheckpointError(
                f"table '{mc.table}': more held raw ids route to this rank than it has slots, and its eviction "
                f"policy {mc.policy_name} is not one this library can rank ids by (LFU, LRU, DistanceLFU). "
                "Restore onto a world size with more slots per rank")
        kept = mine[torch.argsort(scores, descending=True, stable=True)[:capacity]]
        log.warning("table '%s': %d held raw ids route to rank %d, which has %d slots for them; its eviction "
                    "policy (%s) kept %d and dropped %d", table, mine.numel(), rank, capacity,
                    mc.policy_name, capacity, mine.numel() - capacity)
        mine = kept
    return mine[torch.argsort(raw[mine])]


def write_rows(table: str, data: TableData, order: torch.Tensor, miss_row: int | None, mc: McTable,
               tracker: DirtyRowTracker, *, states: bool = True) -> None:
    """Saved rows ``order`` into this rank's first slots of ``table`` (weights, optimizer states unless not
    ``states``, and by-row state), and the weights and optimizer states of saved row ``miss_row`` into its last
    slot (None: the last slot keeps its own)."""
    (kernel, shard), = tracker.shards(table)
    n = order.numel()
    weights = kernel.tbe.split_embedding_weights()[shard.local_index]
    live = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
    states_live = list(live[shard.local_index]) if live and states else []
    if states and len(states_live) != len(data.states):
        raise IncompatibleCheckpointError(
            f"table '{table}': checkpoint has {len(data.states)} optimizer states, the model {len(states_live)}; "
            "restore with the optimizer it was saved with")
    cols = shard.cols
    with torch.no_grad():
        weights[:n] = data.weights[order, cols[0]:cols[1]].to(weights)
        for live_state, saved in zip(states_live, data.states):
            moved = saved.rows(order).for_shard((0, n), cols)
            live_state.reshape(shard.num_rows, -1)[:n] = moved.reshape(n, -1).to(live_state)
        if miss_row is not None:
            weights[-1] = data.weights[miss_row, cols[0]:cols[1]].to(weights)
            for live_state, saved in zip(states_live, data.states):
                row = saved.for_shard((miss_row, miss_row + 1), cols)
                live_state.reshape(shard.num_rows, -1)[-1] = row.reshape(-1).to(live_state)
    state = empty_state(mc.num_rows, len(mc.fields))
    assert data.mc is not None  # relocate_tables refused a table saved without its managed-collision state
    state[:n] = data.mc[order]
    mc.load_by_row(state)


def _saved_runtime(tip: Manifest, storage: Storage, mc: McTable) -> list[dict[str, Any]]:
    """Every saved rank's eviction window and counters of the table, from the tip.

    Raises:
        CorruptCheckpointError: a window that no module could have saved (names the file).
    """
    out = []
    for report in tip.ranks:
        if mc.table in report.mc_runtime:
            try:
                state = unflatten_state(report.mc_runtime[mc.table], RowReader(storage, report.payload))
                # The checks of this module's own window, but the pending rows: they are the saving rank's.
                mc.check_runtime({**state, "pending": torch.empty(0, dtype=torch.int64), "evicted": False}
                                 if isinstance(state, dict) else state)
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptCheckpointError(
                    f"{report.file}: the saved eviction window of table '{mc.table}' is malformed ({e}); the "
                    "manifest of this checkpoint was edited or crafted", path=report.file) from None
            out.append(state)
    return out


def _routed_runtime(saved: list[dict[str, Any]], mc: McTable, rank: int, world_size: int,
                    ranks: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """This rank's eviction window after a reshard: every saved rank's history entries whose raw ids route
    here (``ranks``), in saved rank order, and the counters (every rank steps alike)."""
    if not saved:
        return mc.runtime()
    first = saved[0]
    history: list[Any] = []
    metadata: dict[str, list[Any]] = {k: [] for k in first["history_metadata"]}
    for r in saved:
        ids = r["history"]
        here = ranks(ids) == rank
        history.append(ids[here])
        for k in metadata:
            metadata[k].append(r["history_metadata"][k][here])
    sizes = [int(r["history_size"]) for r in saved if int(r["history_size"]) > 0]
    # Sized as the module sizes it (its share of the global batch's ids over the window), never below what came.
    size = -(-sum(sizes) // world_size) if sizes else -1
    return {**first, "history_size": size,
            "history": torch.cat(history) if history else torch.empty(0, dtype=torch.int64),
            "history_metadata": {k: torch.cat(v) for k, v in metadata.items()},
            "evicted": False, "pending": torch.empty(0, dtype=torch.int64)}
