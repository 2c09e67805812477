"""TorchRec's golden training program (``examples/golden_training/train_dlrm.py``) checkpointed with cnr_torchrec.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 1 \\
        examples/golden_training.py --root /tmp/cnr_golden --steps 300 --save-every 50 \\
        --fail-at-step 230 --fail-rank 1 --out /tmp/cnr_golden.json

The program TorchRec ships, on CPU and gloo with small tables: a ``DLRMTrain`` over an EmbeddingBagCollection,
row-wise Adagrad applied in the backward to the tables, a ``KeyedOptimizerWrapper`` of Adagrad over the dense
parameters, ``TrainPipelineSparseDist`` and ``RandomRecDataset``. cnr_torchrec adds what its README says:
``CheckNRunDMP`` in place of ``DistributedModelParallel``, a ``Checkpointer``, a restore at the start and a save
every ``--save-every`` steps. ``--fail-at-step S --fail-rank R`` kills rank R with SIGKILL right before step S in
the first incarnation; torchrun (``--max-restarts 1``) starts both ranks again, they restore the newest checkpoint
and train on. The environment variable keeps the restarted gloo group off the dead one's store
(pytorch/pytorch#135712).

Step ``s`` (1, 2, ... ``--steps``) trains batch ``s - 1`` of each rank's stream, and the checkpoint of step ``s``
holds the state after it. A job that restores step ``s`` therefore trains on from step ``s + 1``, and reads its
data from batch ``s``. RandomRecDataset has no ``state_dict``; with a ``manual_seed`` and
``num_generated_batches=-1`` it draws every batch in turn from its own generator, so batch ``i`` is the same in
every incarnation, and skipping the first ``s`` batches is the whole resume of the data. The pipeline reads a
batch or two ahead of the one it trains, but the skip counts steps, not batches read. Nothing in training draws
from the global RNG (it only initialises the weights, which a restore overwrites), so the program does not ask
for ``restore_rng``.

At the end each rank evaluates held-out batches, and rank 0 writes ``--out``: the eval loss, the step restored
(null for a fresh start), and a digest of every tensor each rank holds (table shards, fused optimizer state, dense
parameters, dense optimizer state), so that two runs can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from cnr_torchrec import CheckNRunDMP, Checkpointer, CheckpointNotFoundError, QuantizationConfig, load_config

# Six small tables of 16-wide rows, one feature each, as TorchRec's program has one per Criteo feature.
TABLE_ROWS = [1_000, 2_000, 3_000, 5_000, 8_000, 10_000]
FEATURES = [f"cat_{i}" for i in range(len(TABLE_ROWS))]
DIM = 16
NUM_DENSE = 13
BATCH_SIZE = 64
LEARNING_RATE = 0.1


def dlrm_train(tables_device: torch.device, device: torch.device) -> DLRMTrain:
    """The program's DLRMTrain, unsharded: its tables on ``tables_device`` (``meta`` for DMP, which allocates
    the shards), the dense layers on ``device``."""
    tables = [
        EmbeddingBagConfig(name=f"t_{feature}", embedding_dim=DIM, num_embeddings=rows, feature_names=[feature])
        for feature, rows in zip(FEATURES, TABLE_ROWS)
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=tables_device),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, DIM],
        over_arch_layer_sizes=[32, 1],
        dense_device=device,
    )
    return DLRMTrain(dlrm)


def build_model(device: torch.device) -> tuple[CheckNRunDMP, KeyedOptimizerWrapper]:
    """The sharded DLRMTrain (its tables updated in the backward by row-wise Adagrad) and its dense optimizer."""
    train_model = dlrm_train(torch.device("meta"), device)
    # FBGEMM runs it on CPU as EXACT_ROWWISE_ADAGRAD, fused into the tables' backward.
    apply_optimizer_in_backward(RowWiseAdagrad, train_model.model.sparse_arch.parameters(), {"lr": LEARNING_RATE})
    model = CheckNRunDMP(module=train_model, device=device, sharders=[EmbeddingBagCollectionSharder()])
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=LEARNING_RATE),
    )
    return model, dense_optimizer


def dataset(seed: int) -> RandomRecDataset:
    """An endless stream of batches whose ``i``-th is fixed by ``seed`` (no pool of batches cycled over)."""
    return RandomRecDataset(
        keys=FEATURES,
        batch_size=BATCH_SIZE,
        hash_sizes=TABLE_ROWS,
        ids_per_feature=4,
        min_ids_per_feature=1,
        num_dense=NUM_DENSE,
        manual_seed=seed,
        num_generated_batches=-1,
    )


def eval_seed(seed: int) -> int:
    """The held-out stream's seed of rank 0 (rank r reads ``eval_seed(seed) + r``)."""
    return 10_000 * (seed + 1)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, seed: int, batches: int) -> float:
    """The mean loss over ``batches`` held-out batches of every rank (eval mode: nothing is updated or marked)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in itertools.islice(iter(dataset(seed + dist.get_rank())), batches):
        loss, _ = model(batch)
        total += torch.tensor([float(loss), 1.0], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def digests(tree: Any, prefix: str = "") -> dict[str, str]:
    """A sha256 of every tensor in ``tree`` (this rank's shards of a ShardedTensor), by its path in the tree."""
    if hasattr(tree, "local_shards"):  # a ShardedTensor: this rank's shards, by offset
        return {f"{prefix}@{list(s.metadata.shard_offsets)}": _sha(s.tensor) for s in tree.local_shards()}
    if isinstance(tree, torch.Tensor):
        return {prefix: _sha(tree)}
    if isinstance(tree, dict):
        return {k: v for key in sorted(tree, key=str) for k, v in digests(tree[key], f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, item in enumerate(tree) for k, v in digests(item, f"{prefix}/{i}").items()}
    return {prefix: repr(tree)}


def _sha(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes() + str(t.dtype).encode()).hexdigest()[:16]


def kill_self(rank: int, step: int, ckpt: Checkpointer) -> None:
    """The injected failure: this rank dies as a crashed process does, right before ``step``."""
    # The newest save is let commit first, so that which checkpoint the restart finds is known (the last
    # multiple of --save-every); a crash mid-write is make reliability's business, not this program's.
    ckpt.wait()
    print(f"[rank {rank}] injected failure before step {step}: SIGKILL", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="checkpoint root")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--fail-at-step", type=int, default=None, help="kill --fail-rank right before this step")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--eval-batches", type=int, default=100, help="held-out batches per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp32", action="store_true",
                        help="store rows and optimizer state in float32 (method none): a restore is bit-exact")
    parser.add_argument("--out", default=None, help="rank 0 writes the eval loss and the state's digests here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    first_incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    torch.manual_seed(args.seed)  # the initial weights, the same in every incarnation (a restore overwrites them)
    model, dense_optimizer = build_model(device)
    # --fp32: the consecutive config with its quantization section replaced whole: rows and optimizer state in
    # float32 (method "none"), so a restore gives back every bit. Without it, the shipped 4-bit coding.
    overrides: dict[str, Any] = {"quantization": QuantizationConfig(method="none")} if args.fp32 else {}
    config = load_config("consecutive", root=args.root, **overrides)

    with Checkpointer(model, config, dense_optimizer=dense_optimizer) as ckpt:
        try:
            restored: int | None = ckpt.restore()  # the state after step `restored`
        except CheckpointNotFoundError:
            restored = None
        done = 0 if restored is None else restored
        if rank == 0:
            print(f"restored step {restored}, training from step {done + 1}" if restored is not None
                  else "no checkpoint: training from step 1", flush=True)

        # Each rank its own stream; the first `done` batches were trained before the checkpoint.
        batches = itertools.islice(iter(dataset(1000 * (args.seed + 1) + rank)), done, None)
        pipeline = TrainPipelineSparseDist(model, dense_optimizer, device)
        for step in range(done + 1, args.steps + 1):
            if step == args.fail_at_step and rank == args.fail_rank and first_incarnation:
                kill_self(rank, step, ckpt)
            loss, _, _ = pipeline.progress(batches)  # forward, backward (tables updated), dense optimizer step
            if step % args.save_every == 0 or step == args.steps:
                handle = ckpt.save(step)  # the state after this step's update; written in the background
                if rank == 0:
                    what = "skipped (the previous save is still writing)" if handle.skipped else handle.kind
                    print(f"step {step}: loss {float(loss):.4f}, save: {what}", flush=True)
        pipeline.detach()  # the model's own forward again, for the eval

    loss = eval_loss(model, seed=eval_seed(args.seed), batches=args.eval_batches)
    state = {"model": model.state_dict(), "fused_optimizer": model.fused_optimizer.state_dict(),
             "dense_optimizer": dense_optimizer.state_dict()}
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, digests(state))
    if rank == 0:
        print(f"eval loss {loss:.6f} after step {args.steps}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"eval_loss": loss, "restored_step": restored, "steps": args.steps,
                           "state": every_rank}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
