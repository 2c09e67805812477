"""A 2-rank torchrun job that ends with its Checkpointer in a given state (tests/test_exit.py).

    torchrun --standalone --nproc_per_node 2 tests/_exit_job.py --root R --images D --state STATE

The quickstart's model trains and saves every step (a baseline, then 4-bit residual deltas; a background
compaction every 2 deltas, the memory image kept under D). After the last save the job ends as its state says:
``close()`` called or not, the process group destroyed or not, and, with ``CNR_FAULT=...:pause=MS`` set by the
test, a save's write, its memory-image update or a compaction still under way in the background. Every job then
does what jobs do last (an eval all_reduce, an all_gather_object) and returns from main; rank 0 prints the last
save's id first.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/, from a torchrun worker

from examples.quickstart import build, train  # noqa: E402

from cnr_torchrec import Checkpointer, load_config  # noqa: E402

STATES = {
    # state: (saves, close(), destroy_process_group())
    "closed": (4, True, True),
    "unclosed": (4, False, True),
    "unclosed-group-kept": (4, False, False),
    "closed-group-kept": (4, True, False),
    "save-writing": (4, False, True),  # with a pause at write.after: the last save's write outlives main
    "image-updating": (4, False, True),  # a pause at image.mid: the image update outlives main
    "compaction-starting": (4, False, True),  # save 3 (the 4th) starts the compaction; main ends at once
    "compaction-running": (4, False, True),  # a pause at compact.after_write: the merge outlives main
    "compaction-closed": (4, True, True),  # the same, but close() waits for it
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--state", choices=sorted(STATES), required=True)
    args = parser.parse_args()
    saves, close, destroy = STATES[args.state]

    os.makedirs(args.images, exist_ok=True)
    dist.init_process_group("gloo")
    model, opt = build(seed=0)
    config = load_config("consecutive", root=args.root, compaction={"max_chain": 2},
                         memory_tier={"mode": "on", "path": args.images})
    ckpt = Checkpointer(model, config, dense_optimizer=opt)
    last = None
    for step in range(1, saves + 1):
        train(model, opt, step)
        if step > 1:
            ckpt.wait()  # each save commits before the next, so the chain and the compaction are as planned
        last = ckpt.save(step).decision.ckpt_id
    if close:
        ckpt.close()
    if dist.get_rank() == 0:
        print(f"last save {last}", flush=True)

    loss = torch.tensor([float(sum(p.sum() for p in model.parameters() if p.dim() == 2 and p.requires_grad))])
    dist.all_reduce(loss)  # what a job's eval does last
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "loss": float(loss)})
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
