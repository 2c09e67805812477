"""The process group of a benchmark rank, on CPU (gloo) or on CUDA (NCCL, one GPU per rank), and the
wait for queued GPU work that every timer needs.

The benchmarks reduce their timings and byte counts as host tensors: the CUDA group has gloo beside
NCCL for them, so ``dist.all_reduce`` takes host tensors on either device.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL, one GPU per rank (cuda:LOCAL_RANK); cpu: gloo")


def cuda_device_or_exit(parser: argparse.ArgumentParser) -> torch.device:
    """This rank's GPU, ``cuda:LOCAL_RANK``; exits with status 2 and a message where there is none."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= local_world:
        return torch.device("cuda", local_rank)
    why = (f"torch {torch.__version__} is not a CUDA build" if torch.version.cuda is None else
           f"torch sees {count} CUDA device(s) for {local_world} rank(s) on this host")
    if local_rank == 0:
        sys.stderr.write(f"{parser.prog}: --device cuda needs one GPU per rank, but {why}. Run with "
                         "--device cpu (the default), or start one rank per GPU (torchrun --nproc_per_node).\n")
    parser.exit(2)


def init_process_group(device: str, parser: argparse.ArgumentParser) -> torch.device:
    """Starts the default group for ``--device``: on CUDA, NCCL for device tensors beside gloo for host
    ones (``dcp.async_save`` refuses a group without a CPU backend); on CPU, gloo. Returns the device."""
    if device == "cuda":
        dev = cuda_device_or_exit(parser)
        torch.cuda.set_device(dev)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=dev)
        return dev
    dist.init_process_group("gloo")
    return torch.device("cpu")


def sync() -> None:
    """Waits for the GPU's queued work, so that a timer read next counts it (no-op on CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
