"""Benchmark of the row codecs on rows of a trained, sharded TorchRec table.

Trains a one-table EmbeddingBagCollection under a single-rank gloo
DistributedModelParallel (fused EXACT_ROWWISE_ADAGRAD, Zipf-skewed ids, a
learnable target), takes the rows training changed (the rows a differential
checkpoint writes), and for each method x bits reports relative MSE
||x - x^||^2 / ||x||^2, bytes per row, encode and decode GB/s with all threads,
and encode GB/s on one thread. GB/s counts float32 input bytes (decode: output).
Baselines in the same run: a per-row loop of torch.choose_qparams_optimized,
FBGEMM's rowwise 4-bit and 8-bit ops, and a memcpy. Also measured: the adaptive
search against an exhaustive one, and float16 against float32 per-row parameters.

Usage: python benchmarks/codecs.py [--rows 100000] [--json PATH] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from cnr_torchrec.quant import decode, get_codec, ops
from cnr_torchrec.quant import _reference as ref

__all__ = ["trained_rows", "main"]

METHOD_BITS = [("none", 32), ("fp16", 16), ("bf16", 16)] + [
    (m, b) for m in ("uniform_sym", "uniform_asym", "adaptive", "kmeans") for b in (2, 3, 4, 8)
]


def trained_rows(num_embeddings: int, dim: int, steps: int, max_rows: int, seed: int = 0) -> torch.Tensor:
    """Rows that training changed in a table trained through TorchRec's sharded, fused path.

    Args:
        num_embeddings: rows of the table.
        dim: embedding dimension.
        steps: training steps (batch 2048, 8 ids per sample).
        max_rows: at most this many changed rows are returned.
        seed: seed of ids, targets and initialisation.

    Returns:
        float32 ``[min(changed, max_rows), dim]``.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(seed)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=num_embeddings, feature_names=["f"])
                ],
                device=torch.device("meta"),
            )
            self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 8))

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.mlp(self.ebc(kjt).values())

    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    model = Model()
    plan = construct_module_sharding_plan(
        model.ebc,
        per_param_sharding={"t": table_wise(rank=0, compute_kernel="fused")},
        local_size=1,
        world_size=1,
        device_type="cpu",
        sharder=sharder,
    )
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    key = "ebc.embedding_bags.t.weight"
    before = dmp.state_dict()[key].local_shards()[0].tensor.clone()
    dense_opt = torch.optim.Adam([p for n, p in dmp.named_parameters() if "embedding_bags" not in n], lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    # The target of a bag is the sum of hidden per-id vectors: rows must learn distinct values.
    hidden = torch.randn(num_embeddings, 8, generator=g)
    probs = torch.arange(1, num_embeddings + 1, dtype=torch.float64).pow(-1.05)
    batch, pooling = 2048, 8
    for _ in range(steps):
        ids = torch.multinomial(probs, batch * pooling, replacement=True, generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.full((batch,), pooling))
        loss = ((dmp(kjt) - hidden[ids].view(batch, pooling, 8).sum(1)) ** 2).mean()
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
    after = dmp.state_dict()[key].local_shards()[0].tensor
    changed = (after != before).any(dim=1)
    return after[changed][:max_rows].contiguous()


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Fastest of ``reps`` timed calls after one warm-up (the machine is shared and noisy)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()) ** 2).sum().item() / (x.double() ** 2).sum().item()


def with_threads(n: int, fn: Callable[[], float]) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def bench_codecs(x: torch.Tensor, threads: int, reps: int) -> dict[str, dict[str, float]]:
    gb = x.numel() * 4 / 1e9
    out = {}
    for method, bits in METHOD_BITS:
        codec = get_codec(method, None if method in ("none", "fp16", "bf16") else bits)
        enc = codec.encode(x)
        out[f"{method}_{bits}"] = {
            "rel_mse": rel_mse(x, codec.decode(enc)),
            "bytes_per_row": enc.nbytes / x.shape[0],
            "encode_gbps": gb / with_threads(threads, lambda: best_time(lambda: codec.encode(x), reps)),
            "encode_gbps_per_core": gb / with_threads(1, lambda: best_time(lambda: codec.encode(x), reps)),
            "decode_gbps": gb / with_threads(threads, lambda: best_time(lambda: codec.decode(enc), reps)),
        }
    return out


def bench_baselines(x: torch.Tensor, threads: int, reps: int) -> dict[str, float]:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    gb = x.numel() * 4 / 1e9
    sub = x[:500]

    def torch_loop() -> None:
        for row in sub:
            torch.choose_qparams_optimized(row, row.numel(), 200, 0.16, 4)

    def fbgemm_4bit() -> torch.Tensor:
        return torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(x, 4)

    f4 = fbgemm_4bit()
    f8 = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x)
    run = lambda fn: gb / with_threads(threads, lambda: best_time(fn, reps))  # noqa: E731
    return {
        "baseline_torch_loop_gbps": sub.numel() * 4 / 1e9 / with_threads(1, lambda: best_time(torch_loop, 3)),
        "fbgemm_4bit_gbps": run(fbgemm_4bit),
        "fbgemm_8bit_gbps": run(lambda: torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x)),
        "fbgemm_4bit_decode_gbps": run(lambda: torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(f4, 4)),
        "fbgemm_8bit_decode_gbps": run(lambda: torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(f8)),
        "fbgemm_4bit_gbps_per_core": gb / with_threads(1, lambda: best_time(fbgemm_4bit, reps)),
        "memcpy_gbps": run(lambda: x.clone()),
    }


def bench_fbgemm_layout(x: torch.Tensor, threads: int, reps: int) -> dict[str, float]:
    """FBGEMM's layouts through the codec: FBGEMM's ops (plus our NaN check and split) vs our kernels."""
    gb = x.numel() * 4 / 1e9
    out = {}
    for bits, dtype in ((4, "float16"), (8, "float32")):
        for backend in ("fbgemm", "cnr"):
            codec = get_codec("uniform_asym", bits, scale_dtype=dtype, bias_dtype=dtype, backend=backend)
            enc = codec.encode(x)
            t = with_threads(threads, lambda: best_time(lambda: codec.encode(x), reps))
            out[f"{backend}_{bits}bit_encode_gbps"] = gb / t
            out[f"{backend}_{bits}bit_rel_mse"] = rel_mse(x, codec.decode(enc))
        t = with_threads(threads, lambda: best_time(lambda: codec.decode(enc), reps))
        out[f"cnr_{bits}bit_decode_gbps"] = gb / t
    return out


def grid_rel_mse(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int) -> float:
    return ref.grid_error(x, lo, scale, bits).sum().item() / (x.double() ** 2).sum().item()


def bench_search(x: torch.Tensor, rows: int, grid: int, settings: list[tuple[int, float, int]]) -> dict[str, dict]:
    """Adaptive settings (num_bins, ratio, refit_iters) against the exhaustive search on a grid, per bit width."""
    sub = x[:rows].contiguous()
    out = {}
    for bits in (2, 3, 4, 8):
        t_ex = with_threads(1, lambda: best_time(lambda: ops.exhaustive_search(sub, bits, grid), 1))
        ex = grid_rel_mse(sub, *ops.exhaustive_search(sub, bits, grid), bits)
        mn, mx = sub.min(dim=1).values, sub.max(dim=1).values
        entry = {
            "exhaustive_rel_mse": ex,
            "exhaustive_grid": grid,
            "minmax_vs_exhaustive": grid_rel_mse(sub, mn, (mx - mn) / ((1 << bits) - 1), bits) / ex,
        }
        for nb, ratio, refit in settings:
            t = with_threads(1, lambda: best_time(lambda: ops.adaptive_search(sub, bits, nb, ratio, refit), 3))
            err = grid_rel_mse(sub, *ops.adaptive_search(sub, bits, nb, ratio, refit), bits)
            entry[f"nb{nb}_r{ratio}_refit{refit}"] = {"vs_exhaustive": err / ex, "cost_vs_exhaustive": t / t_ex}
        out[str(bits)] = entry
    return out


def noise_model_search(x: torch.Tensor, bits: int, num_bins: int, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy search steered by a cheap error estimate instead of the exact error.

    Clipped values cost exactly (x - lo)^2 or (x - hi)^2 (prefix sums of sorted values
    would give these in O(log D)); values inside cost the uniform-noise estimate
    s^2 / 12 each. Used only to measure how good that estimate is.
    """
    xd = x.double()
    qmax = (1 << bits) - 1
    mn, mx = xd.min(dim=1).values, xd.max(dim=1).values
    step = (mx - mn) / num_bins

    def estimate(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        s = (hi - lo) / qmax
        clipped = ((lo[:, None] - xd).clamp(min=0) ** 2 + (xd - hi[:, None]).clamp(min=0) ** 2).sum(dim=1)
        inside = ((xd >= lo[:, None]) & (xd <= hi[:, None])).sum(dim=1)
        return clipped + inside * s * s / 12

    best_lo, best_hi = mn, mx
    best_e = estimate(mn, mx)
    ups = torch.zeros_like(mn)
    downs = torch.zeros_like(mn)
    for _ in range(min(num_bins - 1, int(num_bins * (1 - ratio) + 1e-9) + 1)):
        e_up = estimate(mn + (ups + 1) * step, mx - downs * step)
        e_down = estimate(mn + ups * step, mx - (downs + 1) * step)
        up = e_up < e_down
        ups, downs = ups + up.double(), downs + (~up).double()
        e = torch.where(up, e_up, e_down)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_lo = torch.where(better, mn + ups * step, best_lo)
        best_hi = torch.where(better, mx - downs * step, best_hi)
    return best_lo.float(), ((best_hi - best_lo) / qmax).float()


def bench_param_dtypes(x: torch.Tensor) -> dict[str, dict]:
    """Error and bytes of each per-row parameter layout: float16 vs float32, per method and width."""
    layouts = {
        "uniform_sym": [{"scale_dtype": "float16"}, {"scale_dtype": "float32"}],
        "uniform_asym": [
            {"scale_dtype": "float16", "bias_dtype": "float16"},
            {"scale_dtype": "float16", "bias_dtype": "float32"},
            {"scale_dtype": "float32", "bias_dtype": "float32"},
        ],
        "adaptive": [
            {"scale_dtype": "float16", "bias_dtype": "float16"},
            {"scale_dtype": "float16", "bias_dtype": "float32"},
            {"scale_dtype": "float32", "bias_dtype": "float32"},
        ],
        "kmeans": [{"codebook_dtype": "float16"}, {"codebook_dtype": "float32"}],
    }
    out = {}
    for method, variants in layouts.items():
        for bits in (2, 3, 4, 8):
            for params in variants:
                codec = get_codec(method, bits, **params)
                enc = codec.encode(x)
                tag = "/".join(str(v).replace("float", "f") for v in params.values())
                out[f"{method}_{bits}_{tag}"] = {
                    "rel_mse": rel_mse(x, decode(enc)),
                    "bytes_per_row": enc.nbytes / x.shape[0],
                }
    return out


def print_table(results: dict[str, dict[str, float]], baselines: dict[str, float]) -> None:
    print(f"\n{'codec':<16}{'rel_mse':>11}{'B/row':>8}{'enc GB/s':>10}{'enc/core':>10}{'dec GB/s':>10}")
    for key, r in results.items():
        print(
            f"{key:<16}{r['rel_mse']:>11.3e}{r['bytes_per_row']:>8.1f}{r['encode_gbps']:>10.3f}"
            f"{r['encode_gbps_per_core']:>10.3f}{r['decode_gbps']:>10.3f}"
        )
    print()
    for key, v in baselines.items():
        print(f"{key:<28}{v:>10.4f}")


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns (and optionally writes) the results.

    Args:
        argv: command-line arguments (default: sys.argv).

    Returns:
        The results dict that ``--json`` writes.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows to encode (changed rows of the table)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (the fastest counts)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for the all-threads figures")
    parser.add_argument("--search-rows", type=int, default=500, help="rows for the exhaustive-search comparison")
    parser.add_argument("--sweep", action="store_true", help="also sweep adaptive settings and the noise-model search")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    x = trained_rows(int(args.rows * 1.5), args.dim, args.steps, args.rows)
    train_s = time.perf_counter() - t0
    print(f"{x.shape[0]} trained rows x {x.shape[1]} (|x| mean {x.abs().mean():.4f}, std {x.std():.4f}); "
          f"training took {train_s:.1f}s; {args.threads} threads")

    results: dict = bench_codecs(x, args.threads, args.reps)
    baselines = bench_baselines(x, args.threads, args.reps)
    results.update(baselines)
    print_table({k: v for k, v in results.items() if isinstance(v, dict)}, baselines)

    default = get_codec("adaptive", 4).params
    # The codec's default, the paper's algorithm as is, and torch's per-tensor settings
    # (its ratio 0.16 is the share of the range it may clip: 0.84 in our terms).
    settings = [(default["num_bins"], default["ratio"], default["refit_iters"]), (25, 0.6, 0), (200, 0.84, 0)]
    if args.sweep:
        settings += [
            (25, 0.6, 2), (25, 0.6, 4), (25, 0.6, 8), (16, 0.5, 4), (20, 0.6, 3), (32, 0.5, 4),
            (50, 0.5, 0), (50, 0.5, 2), (100, 0.5, 0), (200, 0.16, 0), (25, 0.4, 0), (25, 0.4, 3),
        ]
    results["adaptive_vs_exhaustive"] = bench_search(x, args.search_rows, 200, settings)
    if args.sweep:
        sub = x[: args.search_rows].contiguous()
        for bits in (2, 3, 4):
            ex = results["adaptive_vs_exhaustive"][str(bits)]["exhaustive_rel_mse"]
            est = grid_rel_mse(sub, *noise_model_search(sub, bits, 25, 0.6), bits)
            results["adaptive_vs_exhaustive"][str(bits)]["noise_model_nb25_r0.6_vs_exhaustive"] = est / ex
    results["param_dtype"] = bench_param_dtypes(x)
    results["fbgemm_layout"] = bench_fbgemm_layout(x, args.threads, args.reps)
    adaptive = results["adaptive_4"]
    results["targets"] = {
        "adaptive_4_encode_gbps_per_core": adaptive["encode_gbps_per_core"],
        "adaptive_4_per_core_vs_torch_loop": adaptive["encode_gbps_per_core"] / results["baseline_torch_loop_gbps"],
        "adaptive_4_all_threads_vs_torch_loop": adaptive["encode_gbps"] / results["baseline_torch_loop_gbps"],
        "order_adaptive_asym_sym": {
            str(b): results[f"adaptive_{b}"]["rel_mse"] <= results[f"uniform_asym_{b}"]["rel_mse"]
            <= results[f"uniform_sym_{b}"]["rel_mse"]
            for b in (2, 3, 4)
        },
        "kmeans_at_least_adaptive": {
            str(b): results[f"kmeans_{b}"]["rel_mse"] <= results[f"adaptive_{b}"]["rel_mse"] for b in (2, 3, 4, 8)
        },
    }
    results["setup"] = {
        "rows": x.shape[0],
        "dim": x.shape[1],
        "threads": args.threads,
        "training_steps": args.steps,
        "table_rows": int(args.rows * 1.5),
        "seconds": time.perf_counter() - t0,
        "median_abs_value": statistics.median(x.abs().flatten()[:100000].tolist()),
    }
    print("\nadaptive vs exhaustive (rel MSE ratio, cost ratio):")
    for bits, entry in results["adaptive_vs_exhaustive"].items():
        print(f"  {bits} bits: " + ", ".join(
            f"{k} {v['vs_exhaustive']:.4f}/{v['cost_vs_exhaustive']:.4f}" if isinstance(v, dict) else f"{k} {v:.4g}"
            for k, v in entry.items()
        ))
    print("\nper-row parameter layouts (rel MSE, bytes/row):")
    for k, v in results["param_dtype"].items():
        print(f"  {k:<34}{v['rel_mse']:>11.4e}{v['bytes_per_row']:>7.1f}")
    layout = {k: round(v, 4) for k, v in results["fbgemm_layout"].items()}
    print("\nFBGEMM layouts through the codec:", json.dumps(layout))
    print("\ntargets:", json.dumps(results["targets"]))
    print(f"done in {results['setup']['seconds']:.0f}s")
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
