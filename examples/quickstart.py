"""Quickstart: a TorchRec model checkpointed with cnr_torchrec, on 2 CPU ranks.

    torchrun --standalone --nproc_per_node 2 examples/quickstart.py --root /tmp/cnr_quickstart

A complete program, and nothing else: an EmbeddingBagCollection with a fused optimizer, a dense
part with its own optimizer, ``CheckNRunDMP`` where ``DistributedModelParallel`` would be, and a
``Checkpointer`` that saves every 5 steps (a baseline, then 4-bit deltas of the rows that changed).
After 20 steps a second model, built from another seed, restores the newest checkpoint and is
compared with the first. It runs from any directory once cnr_torchrec is installed.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.optim.optimizers import in_backward_optimizer_filter

from cnr_torchrec import CheckNRunDMP, Checkpointer, load_config

TABLES = [
    EmbeddingBagConfig(name="user_table", num_embeddings=10_000, embedding_dim=16, feature_names=["user"]),
    EmbeddingBagConfig(name="item_table", num_embeddings=50_000, embedding_dim=16, feature_names=["item", "last_item"]),
]
FEATURES = ["user", "item", "last_item"]


class Model(torch.nn.Module):
    """Pooled embeddings of three features (two share ``item_table``) into a small MLP: a click logit."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(TABLES, device=torch.device("meta"))  # DMP materialises the shards
        self.mlp = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.mlp(self.ebc(features).values()).squeeze(1)


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The sharded model (tables updated in backward by fused row-wise Adagrad) and the dense optimizer."""
    torch.manual_seed(seed)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    model = CheckNRunDMP(Model(), device=torch.device("cpu"),
                         sharders=[EmbeddingBagCollectionSharder(fused_params=fused)])
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return model, torch.optim.Adam(dense, lr=0.01)


def batch(step: int, batch_size: int = 64) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """This rank's batch of ``step``: 1 to 4 ids per feature and sample, skewed towards low ids, and labels."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    lengths = torch.randint(1, 5, (len(FEATURES), batch_size), generator=gen)
    sizes = [t.num_embeddings for t in TABLES for _ in t.feature_names]
    values = [(torch.rand(int(n), generator=gen) ** 3 * size).long() for n, size in zip(lengths.sum(1), sizes)]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=torch.cat(values), lengths=lengths.view(-1))
    return kjt, torch.randint(0, 2, (batch_size,), generator=gen).float()


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    features, labels = batch(step)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(features), labels)
    loss.backward()  # the fused optimizer updates the looked-up rows here
    opt.step()
    opt.zero_grad()


def rows(model: torch.nn.Module) -> dict[tuple[str, int], torch.Tensor]:
    """This rank's table shards (a rank may hold none of a table), as the DMP's state_dict holds them."""
    return {(k, i): shard.tensor.clone() for k, v in model.state_dict().items() if k.startswith("ebc.")
            for i, shard in enumerate(v.local_shards())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/tmp/cnr_quickstart", help="checkpoint root (a new directory)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    # The config the package ships, as the README loads it: consecutive deltas of 4-bit residual rows.
    config = load_config("consecutive", root=args.root)

    model, opt = build(seed=0)
    with Checkpointer(model, config, dense_optimizer=opt) as ckpt:
        for step in range(1, args.steps + 1):
            train(model, opt, step)
            if step % 5 == 0:
                info = ckpt.save(step).wait()  # training stalls only for the copy to host
                if dist.get_rank() == 0:
                    print(f"step {step}: {info.kind} {info.id}, {info.nbytes / 1e6:.2f} MB")

    again, opt2 = build(seed=1)  # other weights: everything below comes from the checkpoint
    with Checkpointer(again, config, dense_optimizer=opt2) as ckpt:
        step = ckpt.restore()
    trained, restored = rows(model), rows(again)
    error = max((float((restored[k] - trained[k]).abs().max()) for k in trained), default=0.0)
    dense = all(torch.equal(a, b) for a, b in zip(model.module.mlp.parameters(), again.module.mlp.parameters()))
    if dist.get_rank() == 0:
        print(f"restored step {step}: largest row difference {error:.4f} (4-bit rows), dense part exact: {dense}")
    assert step == args.steps and dense and error < 0.05
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
