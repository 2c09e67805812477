"""The restore's decode kernel on one in-memory entry: what a restore's apply could reach at best.

Run:  python benchmarks/restore_kernel.py [--rows 2000000] [--dim 32] [--dirty 0.27] [--json PATH]

One float32 shard of ``--rows`` x ``--dim`` (the live weights), and one chain member held in memory:
``--dirty`` of its rows, 4-bit adaptive-coded (the default codec), at random rows. Timed, each the
median of ``--reps``, on 1 and on 2 intra-op threads:

* ``write``: ``dequantize_uniform_into_`` writing the rows into the shard (a plain chain's apply);
* ``add``: the same with ``accumulate=True`` (a residual chain's apply: decoded, then added);
* peer ``index_copy_``: the rows already decoded to float32, copied into the shard by ATen, the
  memory-bound floor of writing them without decoding.

Throughput is in stored MB per second (the encoded payload, its per-row scale and bias) and in
float32 GB per second written. The restore's own figure, the stored bytes its apply phase applies
per second, comes from ``benchmarks/checkpoint.py`` and ``benchmarks/scale.py``
(``minimal_bytes`` / ``apply_ms``); this sets it beside the kernel's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cnr_torchrec.quant import decode, get_codec


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(rows: int, dim: int, dirty: float, reps: int, threads: int) -> dict[str, float]:
    """The kernel's figures on ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    shard = torch.randn(rows, dim, generator=gen)
    where = torch.randperm(rows, generator=gen)[: int(rows * dirty)].sort().values
    codec = get_codec("adaptive", 4)
    encoded = codec.encode(torch.randn(where.numel(), dim, generator=gen) * 0.01)
    decoded = decode(encoded).float()
    stored = sum(t.numel() * t.element_size() for t in (encoded.payload, encoded.scale, encoded.bias)
                 if t is not None)
    written = where.numel() * dim * 4
    out = {"threads": threads, "stored_mb": stored / 1e6, "written_mb": written / 1e6}
    for name, fn in (
        ("write", lambda: codec.decode_into(encoded, shard, where)),
        ("add", lambda: codec.decode_into(encoded, shard, where, accumulate=True)),
        ("index_copy", lambda: shard.index_copy_(0, where, decoded)),
    ):
        fn()  # warm: the shard's pages and the code paths
        ms = median_ms(fn, reps)
        out[f"{name}_ms"] = ms
        out[f"{name}_stored_mb_per_s"] = stored / 1e6 / (ms / 1e3)
        out[f"{name}_written_gb_per_s"] = written / 1e9 / (ms / 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--dirty", type=float, default=0.27)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    results = [measure(args.rows, args.dim, args.dirty, args.reps, t) for t in (1, 2)]
    print(f"one in-memory entry: {args.dirty:.0%} of {args.rows:,} x {args.dim} float32 rows, adaptive 4-bit "
          f"({results[0]['stored_mb']:.1f} MB stored, {results[0]['written_mb']:.1f} MB of float32 written); "
          f"medians of {args.reps}")
    print(f"{'threads':>7} {'kernel':>10} {'ms':>8} {'stored MB/s':>12} {'float32 GB/s':>13}")
    for r in results:
        for name in ("write", "add", "index_copy"):
            print(f"{r['threads']:>7} {name:>10} {r[f'{name}_ms']:>8.1f} {r[f'{name}_stored_mb_per_s']:>12.0f} "
                  f"{r[f'{name}_written_gb_per_s']:>13.2f}")
    one, two = results
    print(f"add / write, per stored byte: {one['add_ms'] / one['write_ms']:.2f}x on 1 thread, "
          f"{two['add_ms'] / two['write_ms']:.2f}x on 2")
    print(f"2 threads / 1 thread, speed-up: write {one['write_ms'] / two['write_ms']:.2f}x, "
          f"add {one['add_ms'] / two['add_ms']:.2f}x (target >= 1.7x), index_copy "
          f"{one['index_copy_ms'] / two['index_copy_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
