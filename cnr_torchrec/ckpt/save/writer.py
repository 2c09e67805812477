"""The background half of a save: encodes the staged rows and streams the rank's payload out in chunks.

Each shard is coded in row blocks (:mod:`~cnr_torchrec.ckpt.save.coding`: whole, or in a residual
chain each row whole or as a residual). Blobs go to a :class:`~cnr_torchrec.ckpt.format.bytes.chunks.PayloadWriter`,
which writes full chunks on the I/O threads while the next shard is encoded. The
function returns the rank's report, which rank 0 folds into the manifest.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cnr_torchrec.ckpt.format.blocks import shard_key
from cnr_torchrec.ckpt.format.bytes.chunks import IOPool, PayloadWriter
from cnr_torchrec.ckpt.format.bytes.payload import flatten_state
from cnr_torchrec.ckpt.format.bytes.rows import write_rows
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import rank_file
from cnr_torchrec.ckpt.format.row_ids import encode_ids, encode_modes
from cnr_torchrec.ckpt.format.writing import StateBlobs, WriteCounts, rank_report, table_entry
from cnr_torchrec.ckpt.save.coding import code_residual, encode_in_blocks
from cnr_torchrec.ckpt.save.planner import Decision
from cnr_torchrec.ckpt.save.residual import Reconstruction
from cnr_torchrec.ckpt.save.staging import Staged, StagedShard
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.quant import Codec, EncodedRows

__all__ = ["write_rank"]


def _encode_shard(codec: Codec, s: StagedShard, d: Decision, reconstruction: Reconstruction | None,
                  residual: bool) -> tuple[EncodedRows, torch.Tensor | None]:
    """The shard's encoded rows and, for residual rows (see :mod:`.residual`), which rows are coded whole
    (:mod:`.coding`; None: the rows are not residuals).

    A delta's residuals are coded against what its parent's chain restores: the previous checkpoint's,
    or, for the delta that hangs on a compacted baseline (``since`` the baseline: the rows dirty since the
    compaction's tip), the folded rows that baseline holds. A baseline writes its rows whole, and so does
    a delta with no reference to code against. Without ``residual`` (plain coding, with the memory tier's
    image as the reconstruction) every row is coded whole and the reconstruction is told what it restores.
    """
    key = shard_key(s.table, s.rows, s.cols)
    if reconstruction is None:
        return encode_in_blocks(codec, s.weights), None
    if not residual:
        encoded = encode_in_blocks(codec, s.weights)
        reconstruction.stage(key, s.ids, codec.decode(encoded), s.rows[1] - s.rows[0])
        return encoded, None
    if any(not rowwise for _, rowwise in s.states):
        raise ConfigError(f"table '{s.table}': quantization.residual needs row-wise optimizer state (such as "
                          "EXACT_ROWWISE_ADAGRAD's) or none; this optimizer keeps state per column. Turn residual off")
    ref = reconstruction.reference(key, s.ids, on_fold=d.since == "baseline") if d.kind == "delta" else None
    if ref is None:
        encoded = encode_in_blocks(codec, s.weights)
        reconstruction.stage(key, s.ids, codec.decode(encoded), s.rows[1] - s.rows[0])
        return encoded, None
    coded = code_residual(codec, s.weights, ref)
    del ref
    reconstruction.stage(key, s.ids, coded.restored, s.rows[1] - s.rows[0])
    return coded.encoded, coded.whole


def write_rank(
    staged: Staged, codec: Codec, storage: Storage, *, state_dtype: torch.dtype = torch.float32,
    chunk_bytes: int, pool: IOPool | None = None, reconstruction: Reconstruction | None = None,
    residual: bool = True,
) -> dict[str, Any]:
    """Encodes and writes this rank's payload as chunks. Returns the rank's report for the manifest.

    Optimizer-state rows are stored as ``state_dtype`` (restore casts them back). Chunks
    are written on ``pool`` (None: on this thread, through ``storage``). With a
    ``reconstruction``, the rows and optimizer states each shard will restore are staged
    on it for the commit, and with ``residual`` (``quantization.residual``) a delta's rows
    are coded as residuals against it.
    """
    t0 = time.perf_counter()
    d = staged.decision
    if reconstruction is not None and d.kind == "baseline":
        # A baseline writes every row whole, so it needs no reference, and should it fail the next save is a
        # baseline too: the old rows go now, and the new ones take their place rather than join them.
        reconstruction.release()
    blobs = PayloadWriter(storage, rank_file(d.ckpt_id, staged.rank), chunk_bytes, pool)
    tables: dict[str, list[dict[str, Any]]] = {}
    rows_written = residual_entries = whole_rows = 0
    for i, s in enumerate(staged.shards):
        prefix = f"s{i}"
        n_rows = s.rows[1] - s.rows[0]
        ids = None
        if s.ids is not None:
            kind, packed = encode_ids(s.ids, n_rows)
            ids = (kind, int(s.ids.numel()), blobs.add(f"{prefix}/ids", packed))
        encoded, whole = _encode_shard(codec, s, d, reconstruction, residual)
        is_residual = whole is not None and not bool(whole.all())  # a delta whose rows all coded whole is plain
        whole_ref = None
        if whole is not None and is_residual and bool(whole.any()):
            whole_ref = (int(whole.sum()), blobs.add(f"{prefix}/whole", encode_modes(whole)))
            whole_rows += whole_ref[0]
        residual_entries += is_residual
        states = [(t.to(state_dtype) if t.is_floating_point() else t, rowwise) for t, rowwise in s.states]
        if reconstruction is not None:
            reconstruction.stage_states(shard_key(s.table, s.rows, s.cols), s.ids, [t for t, _ in states], s.mc)
        stored = write_rows(blobs, prefix, encoded, states, None if s.mc is None else (s.mc, s.mc_fields))
        rows_written += encoded.num_rows
        tables.setdefault(s.table, []).append(
            table_entry(s.rows, s.cols, s.encoding, stored, ids=ids, residual=is_residual, whole=whole_ref))
    replicated = {name: blobs.add(f"rep/{name}", t) for name, t in staged.replicated_tables.items()}
    dense = {name: blobs.add(f"dense/{name}", t) for name, t in staged.dense.items()}
    where = f"rank {staged.rank}"
    dense_opt = None
    if staged.dense_optimizer is not None:
        dense_opt = flatten_state(staged.dense_optimizer, "dense_optimizer", blobs, f"{where}: dense_optimizer")
    extra = {n: flatten_state(v, f"extra/{n}", blobs, f"{where}: extra_state[{n!r}]") for n, v in staged.extra.items()}
    rng = flatten_state(staged.rng, "rng", blobs, f"{where}: rng")
    mc_runtime = {t: flatten_state(v, f"mc/{t}", blobs, f"{where}: managed collision of '{t}'")
                  for t, v in staged.mc_runtime.items()}

    return rank_report(
        staged.rank, blobs.finish(), tables=tables, table_shapes=staged.table_shapes, tbe_iter=staged.tbe_iter,
        counts=WriteCounts(rows_written, residual_entries, whole_rows, staged.stall_ms,
                           (time.perf_counter() - t0) * 1e3),
        state=StateBlobs(replicated, dense, dense_opt, extra, rng, mc_runtime),
    )
