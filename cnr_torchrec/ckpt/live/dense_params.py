"""The model's dense state by name: its parameters and buffers outside the sharded embedding modules.

A save reads them (rank 0's file holds them), a restore checks the model's against the checkpoint's and writes
them back, and a warm start and a partial recovery look them up; the names are the ones the checkpoint records.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["dense_named_state", "non_persistent_buffers"]


def dense_named_state(model: nn.Module, sharded_modules: Iterable[str]) -> dict[str, torch.Tensor]:
    """Parameters and buffers outside the sharded embedding modules (replicated by DDP), by name.

    Args:
        model: the (DMP-wrapped) model.
        sharded_modules: the names of its sharded embedding modules (``DirtyRowTracker.module_fqns()``).
    """
    sharded = set(sharded_modules)
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        clean = name.removeprefix("module.").replace("._orig_mod", "")
        if any(clean == m or clean.startswith(m + ".") for m in sharded):
            continue
        out[clean] = t
    return out


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """Names (as :func:`dense_named_state` gives them) of the buffers registered with ``persistent=False``.

    A checkpoint written by the Checkpointer holds them; one imported from a ``state_dict`` (DCP) does
    not, and a restore then leaves them as they are.
    """
    from torchrec.distributed.model_parallel import get_unwrapped_module

    out = set()
    for prefix, module in get_unwrapped_module(model).named_modules():  # names as the DMP gives them
        for b in getattr(module, "_non_persistent_buffers_set", ()):
            name = f"{prefix}.{b}" if prefix else b
            out.add(name.removeprefix("module.").replace("._orig_mod", ""))
    return out
