"""This process's random number generators (torch, CUDA, Python, NumPy): their state read for a save and set back by
a restore, as the tensors and JSON-able values of the per-rank state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, Python, NumPy) as tensors and JSON-able values."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    assert not isinstance(np_keys, str)  # the legacy state: its keys are an array
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    keys = nps["keys"].numpy().astype(np.uint32)
    np.random.set_state((nps["name"], keys, nps["pos"], nps["has_gauss"], nps["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
