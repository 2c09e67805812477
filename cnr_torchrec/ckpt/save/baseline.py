"""Writing a baseline from tensors, outside a training job (what ``cnr import-dcp`` commits)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch

from cnr_torchrec.ckpt.format.bytes.chunks import DEFAULT_CHUNK_BYTES
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    committed_ids,
    existing_dir_ids,
    manifest_path,
    remove_partial,
    seal,
    write_index,
)
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.parts import with_parts, write_part
from cnr_torchrec.ckpt.format.schema import check_manifest
from cnr_torchrec.ckpt.format.writing import JobFields, codec_description
from cnr_torchrec.ckpt.save.commit import manifest_body
from cnr_torchrec.ckpt.save.planner import Decision
from cnr_torchrec.ckpt.save.staging import Staged, StagedShard
from cnr_torchrec.ckpt.save.writer import write_rank
from cnr_torchrec.quant import get_codec

__all__ = ["write_baseline"]


def write_baseline(storage: Storage, *, step: int, shards: Iterable[StagedShard], table_shapes: Mapping[str, list[int]],
                   table_fqns: Mapping[str, str], dense: Mapping[str, torch.Tensor], dense_optimizer: Any,
                   reason: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   mc_runtime: Mapping[str, Any] | None = None) -> Manifest:
    """Commits whole tables and dense state as a one-rank, full-precision baseline with the next free id.

    Shards are encoded and written as they come (a generator keeps one table in memory at a time);
    then the sealed manifest commits the baseline and the index is rewritten. A failure before the
    commit removes what was written, so the root is left as it was.

    Args:
        storage: the root to write into.
        step: the training step the baseline records.
        shards: every table whole (``full``, no ids), column slices allowed, with their optimizer states.
        table_shapes: ``[rows, dim]`` of every table, in the manifest's order.
        table_fqns: each table's weight name in the unsharded model, for exports.
        dense: the dense parameters and buffers by name.
        dense_optimizer: the dense optimizer's state by parameter name, or None.
        reason: why this baseline was written, for the manifest.
        mc_runtime: each managed-collision table's eviction window
            (:meth:`~cnr_torchrec.track.managed_collision.McTable.runtime`).

    Returns:
        The committed manifest.
    """
    new_id = max(existing_dir_ids(storage) + committed_ids(storage), default=-1) + 1
    tables = list(table_shapes)
    decision = Decision(new_id, step, "baseline", None, None, (new_id,), {t: "full" for t in tables}, reason)
    # A generator stays one: write_rank consumes the shards once, as they come.
    staged = Staged(decision, 0, 1, shards=cast(list[StagedShard], shards), dense=dict(dense),
                    dense_optimizer=dense_optimizer, table_shapes={t: list(s) for t, s in table_shapes.items()},
                    mc_runtime=dict(mc_runtime or {}))
    codec, t0 = get_codec("none"), time.perf_counter()
    try:
        report = write_rank(staged, codec, storage, chunk_bytes=chunk_bytes)  # consumes the shards lazily
        report["write_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        job = JobFields(policy=None, world_size=1, restores=0, table_fqns=dict(table_fqns),
                        codec=codec_description("none", codec.bits, codec.params))
        body = manifest_body(decision, [write_part(storage, new_id, report)], job, tables, per_rank_state=False)
        manifest = with_parts(check_manifest(body, manifest_path(new_id)), storage)
        storage.write_atomic(manifest_path(new_id), seal(body, key=storage.key))
    except BaseException:
        remove_partial(storage, new_id, 0)
        raise
    write_index(storage, committed_ids(storage))
    return manifest
