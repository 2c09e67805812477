"""Serving a training job's checkpoints: TorchRec's quantized inference model, kept current by a Follower.

    python examples/serve.py --root /tmp/cnr_golden --until-step 300 [--dtype int8] [--poll-s 1] [--json OUT]

It serves ``examples/golden_training.py``'s model: the program's DLRMTrain built unsharded on CPU and quantized
by TorchRec's ``quantize_inference_model`` (int8 row-wise tables, TorchRec's default; ``--dtype int4``; or
``fp32``, the float model). It waits for the root's first committed checkpoint, then follows the root with a
``cnr_torchrec.publish.Follower``: each committed checkpoint is applied in order, only its changed rows read,
and the dense layers with them. After each update it evaluates the training program's held-out batches and
prints the checkpoint served, its step, how it was applied, the lag from its commit, and the served model's
AUC and loss beside the trainer's: those of an unsharded float copy following the same root, which holds what
the trainer restores from that checkpoint (the trainer's own weights, bit for bit, when it saves float32 rows
with ``--fp32``). It stops once it serves ``--until-step`` or after ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchmetrics.functional.classification import binary_auroc  # noqa: E402
from torchrec.inference.modules import quantize_inference_model  # noqa: E402

from cnr_torchrec import CheckpointNotFoundError  # noqa: E402
from cnr_torchrec.publish import Follower  # noqa: E402
from examples.golden_training import dataset, dlrm_train, eval_seed  # noqa: E402

_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2}  # as quantize_inference_model names them


def serving_model(dtype: str) -> torch.nn.Module:
    """The program's model, unsharded, in eval mode: quantized as TorchRec's inference does (int8, int4), or
    float (fp32)."""
    torch.manual_seed(0)  # initial weights, all overwritten by the first checkpoint
    model = dlrm_train(torch.device("cpu"), torch.device("cpu"))
    if dtype != "fp32":
        tables = model.model.sparse_arch.embedding_bag_collection.embedding_bags
        model = quantize_inference_model(model, per_table_weight_dtype={t: _DTYPES[dtype] for t in tables})
    return model.eval()


@torch.no_grad()
def evaluate(model: torch.nn.Module, seed: int, world_size: int, batches: int) -> tuple[float, float]:
    """(AUC, mean loss) over the held-out batches the training program's ranks evaluate on."""
    logits, labels, total = [], [], 0.0
    for rank in range(world_size):
        loss_sum = 0.0
        for batch in itertools.islice(iter(dataset(eval_seed(seed) + rank)), batches):
            loss, (_, out, label) = model(batch)
            loss_sum += float(loss)
            logits.append(out)
            labels.append(label)
        total += loss_sum
    auc = binary_auroc(torch.sigmoid(torch.cat(logits)), torch.cat(labels).long())
    return float(auc), total / (world_size * batches)


def _poll_together(follower: Follower, reference: Follower) -> list:
    """Polls both followers until they serve the same checkpoint (a commit may land between two polls); the
    served model's updates."""
    updates = follower.poll()
    reference.poll()
    while reference.cursor is not None and (follower.cursor is None or reference.cursor.ckpt != follower.cursor.ckpt):
        updates += follower.poll()
        reference.poll()
    return updates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="the training job's checkpoint root")
    parser.add_argument("--dtype", choices=("int8", "int4", "fp32"), default="int8")
    parser.add_argument("--poll-s", type=float, default=1.0, help="seconds between polls of the root")
    parser.add_argument("--until-step", type=int, required=True, help="stop once a checkpoint of this step is served")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--eval-batches", type=int, default=100, help="held-out batches per training rank")
    parser.add_argument("--world-size", type=int, default=2, help="the training job's ranks (whose batches it eval)")
    parser.add_argument("--seed", type=int, default=0, help="the training program's --seed")
    parser.add_argument("--json", default=None, help="write one JSON line per update here")
    args = parser.parse_args()

    served, trainer = serving_model(args.dtype), serving_model("fp32")
    deadline = time.monotonic() + args.timeout_s
    print(f"serve: {args.dtype} model built; following {args.root}", flush=True)
    while not os.path.isdir(args.root):  # the job has not created it yet
        if time.monotonic() > deadline:
            sys.exit(f"serve: {args.root} did not appear within --timeout-s {args.timeout_s:g}")
        time.sleep(args.poll_s)
    out = open(args.json, "w") if args.json else None
    step = None
    with Follower(args.root, served) as follower, Follower(args.root, trainer) as reference:
        while step is None or step < args.until_step:
            if time.monotonic() > deadline:
                sys.exit(f"serve: step {args.until_step} was not served within --timeout-s {args.timeout_s:g}")
            try:
                updates = _poll_together(follower, reference)
            except CheckpointNotFoundError:  # nothing committed yet
                updates = []
            if not updates:
                time.sleep(args.poll_s)
                continue
            auc, loss = evaluate(served, args.seed, args.world_size, args.eval_batches)
            ref_auc, ref_loss = evaluate(trainer, args.seed, args.world_size, args.eval_batches)
            for u in updates:
                line = {"ckpt": u.ckpt, "step": u.step, "how": u.how, "lag_s": u.lag_s, "apply_ms": u.apply_ms}
                if u is updates[-1]:  # the version both models now serve
                    line |= {"auc": auc, "loss": loss, "trainer_auc": ref_auc, "trainer_loss": ref_loss}
                print(f"serving checkpoint {u.ckpt} (step {u.step}, {u.how}): {u.lag_s:.2f} s after its commit"
                      + (f"; {args.dtype} AUC {auc:.4f} loss {loss:.6f} | trainer's AUC {ref_auc:.4f} loss "
                         f"{ref_loss:.6f}" if "auc" in line else ""), flush=True)
                if out is not None:
                    out.write(json.dumps(line) + "\n")
                    out.flush()
            step = updates[-1].step
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
