"""Runs a function on several ranks (gloo, or NCCL on GPUs) in processes of their own, with a hard timeout.

The ranks are forked from a forkserver that has imported torch, FBGEMM, TorchRec and this package once
(Python's ``forkserver`` start method with a preload list): a spawned rank spent 5 s of its life on those imports,
which a test suite of a hundred multi-rank tests paid per rank and per test. A rank starts as clean as a spawned
one (the forkserver runs nothing but the imports), with the caller's working directory and ``sys.path`` (Python's
preparation data) and the caller's environment as it is at the call (forwarded here, as the forkserver's own was
fixed when it started).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


PRELOAD = ["torch", "torch.distributed", "fbgemm_gpu", "torchrec", "torchrec.distributed", "cnr_torchrec",
           "tests._dist"]


def _entry(rank: int, fn: Callable, world_size: int, rdzv: str, args: tuple, backend: str,
           env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
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
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, os.path.join(d, "rdzv"), args, backend, dict(os.environ)),
            nprocs=world_size, join=False, start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks within {timeout:.0f}s")
