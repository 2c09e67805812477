"""Restore: apply a baseline and its deltas, in order, to whatever shards this rank holds now.

Every stored entry carries the global row range and column range of the shard that
wrote it, and its rows carry offsets into that range. A rank therefore reads only the
entries that overlap its current shards and copies the overlapping rows and columns
into its TBE views with ``index_copy_``, whatever the world size and plan were at save
time. Row-wise optimizer state (one value per row of a column shard) is mapped by
column overlap: when a shard now spans columns that several shards held, its value is
their column-weighted mean, which is exact for row-wise Adagrad's mean of squared
gradients whenever the new shard is a union of old ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cnr_torchrec.ckpt.payload import read_blob, unflatten_state
from cnr_torchrec.ckpt.save import decode_ids, dense_named_state, set_rng_state
from cnr_torchrec.ckpt.storage import Storage
from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, decode
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["check_compatible", "restore_chain"]

log = logging.getLogger(__name__)


def check_compatible(manifest: Mapping[str, Any], tracker: DirtyRowTracker) -> None:
    """Raises IncompatibleCheckpointError if the checkpoint's tables differ from the model's."""
    saved = manifest["tables"]
    have = set(tracker.tables())
    missing, extra = sorted(have - set(saved)), sorted(set(saved) - have)
    if missing or extra:
        raise IncompatibleCheckpointError(
            f"checkpoint {manifest['id']} is of another model: tables missing from it {missing}, tables the model "
            f"lacks {extra}. Restore a checkpoint of this model, or start from scratch with a new root."
        )
    for table in sorted(have):
        shape = tracker.table_shape(table)
        if shape is not None and list(shape) != list(saved[table]):
            raise IncompatibleCheckpointError(
                f"table '{table}' is {shape[0]} x {shape[1]} in the model but {saved[table][0]} x {saved[table][1]} "
                f"in checkpoint {manifest['id']}; the model changed shape since it was saved"
            )


class _Reader:
    """Blobs of one rank file. The file is read whole on first use: one request instead of one per blob."""

    def __init__(self, storage: Storage, report: Mapping[str, Any]) -> None:
        self.storage, self.report = storage, report
        self._data: bytes | None = None

    def __call__(self, name: str) -> torch.Tensor:
        try:
            meta = self.report["blobs"][name]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.report['file']}: the manifest names blob {name!r} but does not describe it", self.report["file"]
            ) from None
        if self._data is None:
            self._data = self.storage.read(self.report["file"])
        return read_blob(self.storage, self.report["file"], meta, name, whole=self._data)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class _Applier:
    """Copies the entries of one checkpoint into this rank's shards."""

    def __init__(self, tracker: DirtyRowTracker) -> None:
        self.tracker = tracker
        # Row-wise optimizer state: (shard key, state index) -> (rows, sum of value * weight, sum of weights).
        self._rowwise: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._targets: dict[tuple[int, int], torch.Tensor] = {}

    def apply(self, table: str, entry: Mapping[str, Any], load: Any, weights: torch.Tensor | None = None) -> None:
        rows, cols = tuple(entry["rows"]), tuple(entry["cols"])
        targets = [
            (kernel, shard, r, c)
            for kernel, shard in self.tracker.shards(table)
            if (r := _overlap(rows, shard.rows)) and (c := _overlap(cols, shard.cols))
        ]
        if not targets:
            return
        n_rows = rows[1] - rows[0]
        ids = None
        if "ids" in entry:
            ids = decode_ids(entry["ids"]["kind"], load(entry["ids"]["blob"]), n_rows)
            if ids.numel() != entry["ids"]["count"] or (ids.numel() and int(ids[-1]) >= n_rows):
                raise CorruptCheckpointError("row ids do not match the entry they describe")
        if weights is None:
            tensors = {k: load(name) for k, name in entry["weights"]["blobs"].items()}
            try:
                weights = decode(EncodedRows.from_tensors(tensors, entry["weights"]["meta"]))
            except EncodingFormatError as e:
                raise CorruptCheckpointError(f"encoded rows of table '{table}' are inconsistent: {e}") from None
        offsets = ids if ids is not None else torch.arange(n_rows, dtype=torch.int64)
        if weights.shape[0] != offsets.numel():
            raise CorruptCheckpointError(f"table '{table}': {weights.shape[0]} rows stored for {offsets.numel()} ids")
        global_rows = offsets + rows[0]
        states = [(s["rowwise"], load(s["blob"])) for s in entry.get("states", [])]
        for kernel, shard, (r0, r1), (c0, c1) in targets:
            keep = (global_rows >= r0) & (global_rows < r1)
            if not bool(keep.any()):
                continue
            src = keep.nonzero().squeeze(1)
            dst = global_rows[src] - shard.rows[0]
            view = kernel.tbe.split_embedding_weights()[shard.local_index]
            a, b = c0 - cols[0], c1 - cols[0]
            x, y = c0 - shard.cols[0], c1 - shard.cols[0]
            with torch.no_grad():
                vals = weights[src][:, a:b].to(device=view.device, dtype=view.dtype)
                view[:, x:y].index_copy_(0, dst.to(view.device), vals)
            if not states:
                continue
            live = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
            live_states = list(live[shard.local_index]) if live else []
            if len(live_states) != len(states):
                log.warning("table '%s': checkpoint has %d optimizer states, the model %d; states not restored",
                            table, len(states), len(live_states))
                continue
            for j, ((rowwise, saved), target) in enumerate(zip(states, live_states)):
                if rowwise:
                    target = target.reshape(shard.num_rows)
                    key = (id(target.untyped_storage()), target.storage_offset())
                    self._targets[key] = target
                    weight = (c1 - c0) / (shard.cols[1] - shard.cols[0])
                    self._rowwise.setdefault(key, []).append((dst, saved[src].float(), weight))
                else:
                    target = target.reshape(shard.num_rows, -1)
                    with torch.no_grad():
                        target[:, x:y].index_copy_(0, dst.to(target.device), saved[src][:, a:b].to(target))

    def finish(self) -> None:
        """Writes the row-wise states gathered from every entry of the checkpoint."""
        for key, parts in self._rowwise.items():
            target = self._targets[key]
            acc = torch.zeros(target.shape[0], dtype=torch.float64)
            wsum = torch.zeros(target.shape[0], dtype=torch.float64)
            for dst, vals, weight in parts:
                acc.index_add_(0, dst, vals.double() * weight)
                wsum.index_add_(0, dst, torch.full((dst.numel(),), weight, dtype=torch.float64))
            rows = wsum.nonzero().squeeze(1)
            with torch.no_grad():
                target.index_copy_(0, rows.to(target.device), (acc[rows] / wsum[rows]).to(target))
        self._rowwise.clear()
        self._targets.clear()


def restore_chain(
    manifests: list[dict[str, Any]],
    *,
    storage: Storage,
    model: nn.Module,
    tracker: DirtyRowTracker,
    rank: int,
    world_size: int,
    dense_optimizer: Any,
    extra_state: Mapping[str, Any],
) -> None:
    """Applies ``manifests`` (baseline first) to this rank's model state."""
    target = manifests[-1]
    check_compatible(target, tracker)
    for m in manifests:
        applier = _Applier(tracker)
        for report in m["ranks"]:
            load = _Reader(storage, report)
            for table, entries in report["tables"].items():
                for entry in entries:
                    applier.apply(table, entry, load)
        applier.finish()

    reports = {r["rank"]: r for r in target["ranks"]}
    first = reports[0]
    load0 = _Reader(storage, first)
    for table, blob in first["replicated_tables"].items():
        full = load0(blob).float()
        shape = target["tables"][table]
        applier = _Applier(tracker)
        applier.apply(table, {"rows": [0, shape[0]], "cols": [0, shape[1]], "encoding": "full"}, load0, weights=full)

    dense = dense_named_state(model, tracker)
    missing = sorted(set(dense) - set(first["dense"]))
    if missing:
        raise IncompatibleCheckpointError(
            f"dense parameters {missing} are not in checkpoint {target['id']}; the model's dense part changed"
        )
    with torch.no_grad():
        for name, t in dense.items():
            saved = load0(first["dense"][name])
            if saved.shape != t.shape:
                raise IncompatibleCheckpointError(
                    f"dense parameter '{name}' is {list(t.shape)} in the model, {list(saved.shape)} in the checkpoint"
                )
            t.copy_(saved)
    if dense_optimizer is not None:
        if first["dense_optimizer"] is None:
            raise IncompatibleCheckpointError(
                f"checkpoint {target['id']} holds no dense optimizer state; pass dense_optimizer=None to restore it"
            )
        dense_optimizer.load_state_dict(unflatten_state(first["dense_optimizer"], load0))

    for tbe in tracker.tbes():
        it = getattr(tbe, "iter", None)
        if isinstance(it, torch.Tensor) and it.numel() == 1:
            it.fill_(max(int(r["tbe_iter"]) for r in target["ranks"]))

    if target["world_size"] != world_size:
        log.warning(
            "checkpoint %d was written by %d ranks and is restored onto %d: embedding rows, dense and optimizer "
            "state are resharded; per-rank state (%s, RNG) is not restored",
            target["id"], target["world_size"], world_size, ", ".join(sorted(extra_state)) or "no extra_state",
        )
        return
    mine = reports[rank]
    load = _Reader(storage, mine)
    unknown = sorted(set(extra_state) - set(mine["extra"]))
    if unknown:
        raise IncompatibleCheckpointError(
            f"extra_state {unknown} is not in checkpoint {target['id']} (it has {sorted(mine['extra'])})"
        )
    for name, obj in extra_state.items():
        obj.load_state_dict(unflatten_state(mine["extra"][name], load))
    set_rng_state(unflatten_state(mine["rng"], load))
