"""The background half of a save: encodes the staged rows and writes the rank's payload.

It returns the rank's report, which rank 0 folds into the manifest.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cnr_torchrec.ckpt.format.manifest import rank_file
from cnr_torchrec.ckpt.format.payload import BlobWriter, checksum, flatten_state
from cnr_torchrec.ckpt.format.state import encode_ids
from cnr_torchrec.ckpt.format.storage import Storage
from cnr_torchrec.ckpt.save.staging import Staged
from cnr_torchrec.quant import Codec

__all__ = ["write_rank"]


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
            kind, packed = encode_ids(s.ids, n_rows)
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
