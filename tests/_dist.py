"""Runs a function on several ranks (gloo, or NCCL on GPUs) in spawned processes, with a hard timeout."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, rdzv: str, args: tuple, backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # Print before anything else: tearing down a gloo group with work still queued on
        # the peer can abort the process, and the traceback would then be lost.
        sys.stderr.write(f"[rank {rank}] failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        raise
    # Both ranks finish their collectives before the group goes away, and the process then
    # leaves without running C++ static destructors: gloo and DDP keep helper threads whose
    # destruction at interpreter exit has aborted a finished, passing rank on CI before.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world_size: int = 2, timeout: float = 240.0, args: tuple = (),
              backend: str = "gloo") -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a ``backend`` group; fails on error or
    timeout. With NCCL, rank r runs on ``cuda:r``."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, os.path.join(d, "rdzv"), args, backend), nprocs=world_size, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks within {timeout:.0f}s")
