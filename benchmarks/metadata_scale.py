"""What a checkpoint's metadata costs as the world grows: the format 7 index and parts against format 6's one
manifest, with DCP's ``.metadata`` as the peer, in the same run.

Usage (one process; about 2 minutes with the defaults):

    .venv/bin/python benchmarks/metadata_scale.py [--worlds 2,8,128,1024] [--layouts table8,row64,row1000]
                                                  [--depth 16] [--v6-max-world 128]

Checkpoints are synthesized through the library's own writer. A real delta of one row-wise table of the toy
model is saved first (the default config: adaptive 4-bit, residual coding, rowwise Adagrad); its entry is the
template of every entry: the same codec description, blobs and row count, placed in each layout:

- ``table8``: 8 tables, table-wise: table j whole on rank j mod W;
- ``row64``: 64 tables, row-wise: a shard of every table on every rank;
- ``row1000``: 1,000 tables, row-wise (only up to ``--row1000-max-world`` ranks: its parts are large).

For each layout and world size it prints:

- the index's bytes, a part's bytes, and bytes per entry (a part's over its entries);
- rank 0's commit: the index built from the ranks' lines (:func:`~cnr_torchrec.ckpt.format.writing.manifest_body`),
  checked and sealed, and written atomically; beside it, format 6's commit of the same reports in one manifest
  (up to ``--v6-max-world``);
- a rank's restore metadata for a ``--depth`` chain on the plan that saved: each member's index loaded and
  checked, the rank's own part of each read and checked, and rank 0's part of the tip (the dense state): what a
  same-plan restore asks for, with the
  peak of Python's allocations (tracemalloc); on another plan, every part of every member (one member
  measured, times the depth); format 6: one manifest loaded and checked, times the depth;
- DCP's peer: a ``Metadata`` for the same tables (weights and the rowwise optimizer state, one chunk per shard,
  with ``_StorageInfo`` entries), built with torch's own classes; its pickled bytes and one ``pickle.loads``
  (what every rank of a DCP load does).

Store bytes held after a commit are a property of the protocol (each rank's line is deleted as rank 0 reads it,
the outcome by the last rank to hear it); ``tests/test_parts.py`` checks that a real save leaves the c10d store
as it found it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cnr_torchrec.ckpt.format.bytes.storage import Storage  # noqa: E402
from cnr_torchrec.ckpt.format.commits import load_manifest, manifest_path, rank_file, seal  # noqa: E402
from cnr_torchrec.ckpt.format.parts import write_part  # noqa: E402
from cnr_torchrec.ckpt.format.schema import check_manifest  # noqa: E402
from cnr_torchrec.ckpt.format.writing import (  # noqa: E402
    ChainLinks,
    JobFields,
    StateBlobs,
    WriteCounts,
    manifest_body,
    rank_report,
)

CHUNK_BYTES = 64 << 20


# ---------------------------------------------------------------------- the template

def template_entry(work: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any], int]:
    """A real delta entry of one row-wise table (and the blobs it names, and its codec description), from a save of
    the toy model on one rank with the default config. Returns (entry, blobs, codec, the table's columns)."""
    from cnr_torchrec import Checkpointer, load_config

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from _format_checks import combined_body
    from _toy import build_dmp, train

    from examples.toy import TableSpec

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(work, 'rdzv')}", rank=0, world_size=1)
    specs = [TableSpec("t", 4096, 64, "row_wise", "ebc")]
    dmp, opt = build_dmp(specs)
    root = os.path.join(work, "template")
    ck = Checkpointer(dmp, load_config({"root": root}), dense_optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2):
        train(dmp, specs, opt, 4, gen)
        info = ck.save(step).wait()
    ck.close()
    storage = Storage(root)
    body = combined_body(storage, info.id)
    storage.close()
    report = body["ranks"][0]
    entry = next(e for e in report["tables"]["t"] if "ids" in e)
    names = set(entry["weights"]["blobs"].values()) | {s["blob"] for s in entry["states"]} | {entry["ids"]["blob"],
                                                                                              entry["checks"]["blob"]}
    if "whole" in entry:
        names.add(entry["whole"]["blob"])
    return entry, {n: report["blobs"][n] for n in names}, body["codec"], body["tables"]["t"][1]


def _renamed(entry: dict[str, Any], blobs: dict[str, dict[str, Any]], prefix: str, offset: int,
             rows: tuple[int, int]) -> tuple[dict[str, Any], dict[str, dict[str, Any]], int]:
    """The template entry for another table and row range, its blobs renamed under ``prefix`` and laid out from
    ``offset``. Returns (entry, blobs, the offset after them)."""
    text = json.dumps(entry)
    out_blobs = {}
    for name in sorted(blobs):
        new = f"{prefix}/{name.rsplit('/', 1)[-1]}" if "/w/" not in name else f"{prefix}/w/{name.rsplit('/', 1)[-1]}"
        text = text.replace(json.dumps(name), json.dumps(new))
        meta = dict(blobs[name], offset=offset)
        out_blobs[new] = meta
        offset += -(-meta["nbytes"] // 64) * 64
    e = json.loads(text)
    e["rows"] = list(rows)
    return e, out_blobs, offset


def layout(name: str, world: int, rows: int) -> dict[int, list[tuple[str, tuple[int, int]]]]:
    """Per rank, the (table, row range) of each shard it holds."""
    if name == "table8":
        out: dict[int, list[tuple[str, tuple[int, int]]]] = {r: [] for r in range(world)}
        for j in range(8):
            out[j % world].append((f"t{j}", (0, rows)))
        return out
    tables = 64 if name == "row64" else 1000
    return {r: [(f"t{j}", (r * rows, (r + 1) * rows)) for j in range(tables)] for r in range(world)}


def table_rows(name: str, world: int, rows: int) -> dict[str, int]:
    if name == "table8":
        return {f"t{j}": rows for j in range(8)}
    return {f"t{j}": world * rows for j in range(64 if name == "row64" else 1000)}


def synth_report(rank: int, ckpt_id: int, shards: list[tuple[str, tuple[int, int]]], tpl: tuple, shapes: dict,
                 ) -> dict[str, Any]:
    entry, blobs, _, _ = tpl
    tables: dict[str, list[dict[str, Any]]] = {}
    index: dict[str, dict[str, Any]] = {}
    offset, stored = 0, 0
    for table, rows in shards:
        e, b, offset = _renamed(entry, blobs, f"{table}/{rows[0]}", offset, rows)
        tables.setdefault(table, []).append(e)
        index.update(b)
        stored += e["ids"]["count"]
    # Per-rank state, as a save writes it: torch's CPU RNG state (a 5,056-byte tensor) and Python's.
    index["rng/torch"] = {"offset": offset, "nbytes": 5056, "dtype": "uint8", "shape": [5056], "xxh3": "0" * 32}
    offset += 5056
    rng = {"torch": {"$tensor": "rng/torch"}, "python": [3, list(range(8)), None]}
    n_chunks = max(1, -(-offset // CHUNK_BYTES))
    chunks = [{"nbytes": min(CHUNK_BYTES, offset - k * CHUNK_BYTES) if offset else 0, "xxh3": "0" * 32}
              for k in range(n_chunks)]
    payload = {"file": rank_file(ckpt_id, rank), "nbytes": offset, "chunk_bytes": CHUNK_BYTES, "chunks": chunks,
               "blobs": index}
    residual = sum(1 for es in tables.values() for e in es if e.get("residual"))
    whole = sum(e["whole"]["count"] for es in tables.values() for e in es if "whole" in e)
    return rank_report(rank, payload, tables=tables, table_shapes={t: shapes[t] for t in tables}, tbe_iter=7,
                       counts=WriteCounts(stored, residual, whole), state=StateBlobs(rng=rng))


# ---------------------------------------------------------------------- measurements

def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def peak_mb(fn) -> tuple[Any, float, float]:
    """(result, ms, peak MB of Python allocations) of ``fn()``: timed once as it is, then run again under
    tracemalloc (which slows allocation many times over) for the peak."""
    out, ms = timed(fn)
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, ms, peak / 1e6


def links(ckpt_id: int, depth: int, tables: list[str]) -> ChainLinks:
    if depth == 0:
        return ChainLinks.baseline(ckpt_id, ckpt_id + 1, {t: "full" for t in tables}, "synthetic")
    return ChainLinks(ckpt_id, ckpt_id + 1, "delta", "previous", ckpt_id - 1, ckpt_id - depth, depth,
                      {t: "rows" for t in tables}, "synthetic")


def one_cell(root: str, name: str, world: int, depth: int, tpl: tuple, v6: bool) -> dict[str, Any]:
    """Writes a ``depth``-deep chain of one layout and world size, and measures it."""
    rows = tpl[0]["rows"][1] - tpl[0]["rows"][0]
    shapes = {t: [n, tpl[3]] for t, n in table_rows(name, world, rows).items()}
    where = layout(name, world, rows)
    job = JobFields(policy="consecutive", world_size=world, codec=tpl[2], restores=0)
    storage = Storage(root)
    out: dict[str, Any] = {"layout": name, "world": world}
    # The tip's parts are all written; in the older members only rank 0's and the reading rank's (the parts a
    # same-plan restore reads), the other ranks' lines copied from the tip's (their parts are never read here).
    reader = world // 2
    def boxes(r):  # the rank's shards, as a save records them (its line's layout, the index's shards)
        return sorted([t, a, b, 0, shapes[t][1]] for t, (a, b) in where[r])

    tip_lines = [write_part(storage, depth - 1, synth_report(r, depth - 1, where[r], tpl, shapes), boxes(r))
                 for r in range(world)]
    out["part_bytes"] = tip_lines[reader]["line"]["nbytes"]
    out["entries_per_part"] = len(where[reader])
    tables = list(shapes)
    for cid in range(depth):
        lines = list(tip_lines)
        if cid != depth - 1:
            for r in {0, reader}:
                lines[r] = write_part(storage, cid, synth_report(r, cid, where[r], tpl, shapes), boxes(r))

        def commit(cid=cid, lines=lines):
            body = manifest_body(links(cid, cid, tables), job, tables=shapes, parts=lines)
            check_manifest(body, manifest_path(cid))
            data = seal(body)
            storage.write_atomic(manifest_path(cid), data)
            return len(data)

        out["index_bytes"], ms = timed(commit)
        out.setdefault("commit_ms", []).append(ms)
    out["commit_ms"] = sorted(out["commit_ms"])[len(out["commit_ms"]) // 2]

    def same_plan():  # what a same-plan restore reads: each member's index and own part, the tip's rank 0 part
        for cid in range(depth):
            m = load_manifest(storage, cid)
            m.ranks[reader]
        m.ranks[0]
    _, out["restore_ms"], out["restore_mb"] = peak_mb(same_plan)

    def every_part():
        m = load_manifest(storage, depth - 1)
        return sum(len(r.tables) for r in m.ranks)
    _, ms, mb = peak_mb(every_part)
    out["other_plan_ms"], out["other_plan_mb"] = ms * depth, mb
    if v6:
        reports = [synth_report(r, 0, where[r], tpl, shapes) for r in range(world)]
        body = manifest_body(links(0, 0, list(shapes)), job, tables=shapes, parts=[
            {"line": {"payload": r["nbytes"]}, "replicated": []} for r in reports])
        del body["parts"]
        body["ranks"] = reports

        def commit6():
            check_manifest(body, manifest_path(0))
            data = seal(body, version=6)
            storage.write_atomic("v6/" + manifest_path(0), data)
            return len(data)

        out["v6_bytes"], out["v6_commit_ms"] = timed(commit6)
        v6 = Storage(os.path.join(root, "v6"))
        _, ms, mb = peak_mb(lambda: load_manifest(v6, 0))
        v6.close()
        out["v6_restore_ms"], out["v6_restore_mb"] = ms * depth, mb * depth
    storage.close()
    out["dcp_bytes"], out["dcp_load_ms"] = dcp_peer(name, world, rows, tpl[3])
    return out


def dcp_peer(name: str, world: int, rows: int, dim: int) -> tuple[int, float]:
    """DCP's ``.metadata`` for the same tables (weights and rowwise Adagrad's momentum, one chunk per shard), built
    with torch's classes: (its pickled bytes, ms of one pickle.loads)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    offset = 0
    for table, n in table_rows(name, world, rows).items():
        for key, cols, dtype in ((f"sparse.ebc.embedding_bags.{table}.weight", dim, torch.float32),
                                 (f"optim.state.sparse.ebc.embedding_bags.{table}.weight.momentum1", 1,
                                  torch.float32)):
            chunks = []
            for r, shards in layout(name, world, rows).items():
                for t, (r0, r1) in shards:
                    if t != table:
                        continue
                    chunk = ChunkStorageMetadata(offsets=torch.Size([r0, 0]), sizes=torch.Size([r1 - r0, cols]))
                    chunks.append(chunk)
                    length = (r1 - r0) * cols * 4
                    storage[MetadataIndex(key, chunk.offsets)] = _StorageInfo(f"__{r}_0.distcp", offset, length)
                    offset += length
            sd[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size([n, cols]), chunks)
    data = pickle.dumps(Metadata(state_dict_metadata=sd, storage_data=storage))
    runs = []
    for _ in range(3):
        _, ms = timed(lambda: pickle.loads(data))
        runs.append(ms)
    return len(data), sorted(runs)[1]


# ---------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,8,128,1024")
    p.add_argument("--layouts", default="table8,row64,row1000")
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--v6-max-world", type=int, default=128, help="format 6's peer up to this world size")
    p.add_argument("--row1000-max-world", type=int, default=128)
    p.add_argument("--row1000-v6-max-world", type=int, default=8,
                   help="format 6's peer for 1,000 tables up to this world size (its manifest is 276 MB at 128)")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="cnr-metadata-")
    t_start = time.perf_counter()
    try:
        tpl = template_entry(work)
        print(f"template: a delta entry of {tpl[0]['rows'][1] - tpl[0]['rows'][0]} rows x {tpl[3]} "
              f"({tpl[2]['method']}, {tpl[2]['bits']} bits), {len(json.dumps(tpl[0]))} bytes of JSON "
              f"(of it the codec's description {len(json.dumps(tpl[0]['weights']['meta']))})", flush=True)
        head = (f"{'layout':<8s}{'world':>6s}{'index KB':>10s}{'part KB':>9s}{'B/entry':>8s}{'commit ms':>10s}"
                f"{'restore ms':>11s}{'MB':>7s}{'other ms':>10s}{'MB':>7s}{'v6 MB':>8s}{'v6 commit':>10s}"
                f"{'v6 restore':>11s}{'v6 GB':>7s}{'DCP MB':>8s}{'DCP ms':>8s}{'x DCP':>7s}")
        print(head, flush=True)
        for name in args.layouts.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                if name == "row1000" and world > args.row1000_max_world:
                    continue
                root = os.path.join(work, f"{name}-{world}")
                v6_max = min(args.v6_max_world, args.row1000_v6_max_world) if name == "row1000" else args.v6_max_world
                c = one_cell(root, name, world, args.depth, tpl, world <= v6_max)
                shutil.rmtree(root, ignore_errors=True)
                per_entry = c["part_bytes"] / max(1, c["entries_per_part"])
                v6 = (f"{c['v6_bytes'] / 1e6:>8.2f}{c['v6_commit_ms']:>10.0f}{c['v6_restore_ms']:>11.0f}"
                      f"{c['v6_restore_mb'] / 1e3:>7.2f}" if "v6_bytes" in c else f"{'-':>8s}{'-':>10s}{'-':>11s}"
                      f"{'-':>7s}")
                print(f"{name:<8s}{world:>6d}{c['index_bytes'] / 1e3:>10.1f}{c['part_bytes'] / 1e3:>9.1f}"
                      f"{per_entry:>8.0f}{c['commit_ms']:>10.1f}{c['restore_ms']:>11.1f}{c['restore_mb']:>7.1f}"
                      f"{c['other_plan_ms']:>10.0f}{c['other_plan_mb']:>7.1f}{v6}{c['dcp_bytes'] / 1e6:>8.2f}"
                      f"{c['dcp_load_ms']:>8.1f}{c['restore_ms'] / c['dcp_load_ms']:>7.2f}", flush=True)
        print(f"\nrestore: a rank's metadata for a {args.depth}-deep chain on the plan that saved (indexes, its own "
              "parts, and rank 0's part of the tip); other: every part of every member (one member measured, times the depth); v6: "
              f"format 6's one manifest, loaded and checked once, times {args.depth}; MB: the peak of Python's "
              "allocations (tracemalloc); x DCP: the chain's restore metadata over one pickle.loads of DCP's "
              ".metadata (a DCP checkpoint has no chain)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"run time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
