"""Bytes of a managed-collision table's delta at 10% of its rows dirty, against its baseline in the same run.

Run:  OMP_NUM_THREADS=1 python benchmarks/mc_delta.py [--rows 200000] [--dim 64] [--json PATH]

Workload: one sort-zch table (``MCHManagedCollisionModule``, LFU, ``--rows`` slots of ``--dim``
float32, fused EXACT_SGD, row_wise on one gloo rank) inside a ManagedCollisionEmbeddingBagCollection.
Five steps look up more distinct raw ids than the table has slots, so the eviction at step 5 fills
it; a baseline is saved. Steps 6 to 9 then look up a fixed 10% of the held raw ids (no eviction
falls in them: the interval is 5), and a consecutive delta is saved. Each config writes to a root of
its own: the default config (residual coding, 4-bit), plain 4-bit adaptive, and ``none`` (float32).

Figures, per config: the table's baseline bytes and delta bytes (every blob of its entries: encoded
rows, optimizer state, managed-collision state, row ids, CRCs), their ratio (the target: at most
15%), the rows the delta stores over the table's, and the share of the delta that is remapping state.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

TARGET = 0.15
INTERVAL = 5


def build(rows: int, dim: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    from cnr_torchrec import CheckNRunDMP

    cpu = torch.device("cpu")
    config = EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])
    mch = MCHManagedCollisionModule(zch_size=rows, device=cpu, eviction_policy=LFU_EvictionPolicy(),
                                    eviction_interval=INTERVAL, input_hash_size=1 << 40, name="t")
    model = torch.nn.Module()
    model.mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection([config], device=cpu),
        ManagedCollisionCollection(managed_collision_modules={"t": mch}, embedding_configs=[config]))
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05}
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params=fused))
    plan = construct_module_sharding_plan(model.mc, {"t": row_wise(compute_kernel="fused")}, sharder=sharder,
                                          local_size=1, world_size=1, device_type="cpu")
    return CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=cpu,
                        plan=ShardingPlan({"mc": plan}), sharders=[sharder])


def step(dmp, ids: torch.Tensor) -> None:
    from torchrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones_like(ids))
    pooled, _ = dmp.module.mc(kjt)
    pooled.values().square().mean().backward()


def table_bytes(root: str, table: str) -> list[dict[str, int]]:
    """Per checkpoint under ``root``, oldest first: the table's stored bytes, rows and MC-state bytes."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

    storage = Storage(root)
    out = []
    try:
        for cid in committed_ids(storage):
            m = load_manifest(storage, cid)
            total = rows = mc = 0
            for report in m.ranks:
                for e in report.tables.get(table, ()):
                    names = e.row_blobs + ([e.ids.blob] if e.ids else []) + ([e.checks.blob] if e.checks else [])
                    total += sum(report.blobs[n].nbytes for n in names)
                    mc += report.blobs[e.mc.blob].nbytes if e.mc is not None else 0
                    rows += e.num_stored
            out.append({"bytes": total, "rows": rows, "mc_bytes": mc})
    finally:
        storage.close()
    return out


def run(name: str, quantization: dict, rows: int, dim: int, where: str) -> dict:
    from cnr_torchrec import Checkpointer, load_config

    torch.manual_seed(0)
    dmp = build(rows, dim)
    gen = torch.Generator().manual_seed(1)
    fill = torch.randint(0, 1 << 40, (rows * 2,), generator=gen)
    root = os.path.join(where, name)
    config = load_config({"root": root, "policy": "consecutive", "quantization": quantization, "compaction": None})
    with Checkpointer(dmp, config) as ck:
        for i in range(INTERVAL):  # the eviction at step 5 fills the table
            step(dmp, fill[i * len(fill) // INTERVAL:(i + 1) * len(fill) // INTERVAL])
        ck.save(INTERVAL).wait()
        held = ck.tracker.mc_table("t").by_row()[:, 0]
        held = held[held != torch.iinfo(torch.int64).max]
        hot = held[torch.randperm(held.numel(), generator=gen)[: rows // 10]]
        for _ in range(INTERVAL - 1):  # no eviction before step 10
            step(dmp, hot)
        ck.save(2 * INTERVAL - 1).wait()
    base, delta = table_bytes(root, "t")
    return {"config": name, "baseline_bytes": base["bytes"], "delta_bytes": delta["bytes"],
            "ratio": delta["bytes"] / base["bytes"], "delta_rows_fraction": delta["rows"] / rows,
            "delta_mc_share": delta["mc_bytes"] / delta["bytes"], "met": delta["bytes"] / base["bytes"] <= TARGET}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as where:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(where, "store"), 1), rank=0, world_size=1)
        configs = {"default (residual 4-bit)": {},
                   "adaptive 4-bit": {"method": "adaptive", "bits": 4, "residual": False},
                   "none (float32)": {"method": "none", "residual": False}}
        results = [run(f"c{i}", q, args.rows, args.dim, where) | {"config": name}
                   for i, (name, q) in enumerate(configs.items())]
        dist.destroy_process_group()
    print(f"MC table: {args.rows} rows x {args.dim}, 10% of rows looked up since the baseline "
          f"(target: delta <= {TARGET:.0%} of the baseline)")
    print(f"{'config':26} {'baseline MB':>12} {'delta MB':>10} {'ratio':>7} {'rows':>6} {'MC share':>9}  target")
    for r in results:
        print(f"{r['config']:26} {r['baseline_bytes'] / 1e6:12.2f} {r['delta_bytes'] / 1e6:10.2f} {r['ratio']:7.1%} "
              f"{r['delta_rows_fraction']:6.1%} {r['delta_mc_share']:9.1%}  {'met' if r['met'] else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "dim": args.dim, "target": TARGET, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
