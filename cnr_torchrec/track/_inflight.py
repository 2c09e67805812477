"""Training lookups whose optimizer update has not run yet.

Under FBGEMM's fused optimizers a row changes in the backward of the lookup that
read it. A pipeline that looks up batch i+1 before batch i's backward (TorchRec's
semi-synchronous and prefetching pipelines) can therefore have lookups marked but
not yet applied when a save clears the marks: the rows that save writes are still
the old ones, and the update that follows would be missing from the next
consecutive delta. The tracker keeps such lookups here and marks them again after
every reset, so that they stay dirty until their update has run.

A lookup leaves when the gradient of its output is computed, which is when
autograd is about to run the TBE's backward (and so its update), or when its
output is freed without a backward.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass

import torch

__all__ = ["InFlight", "Lookup"]


@dataclass(frozen=True)
class Lookup:
    """The ids of one marked TBE lookup, as ``cnr::mark_rows`` takes them."""

    indices: torch.Tensor
    offsets: torch.Tensor
    B_offsets: torch.Tensor | None


class InFlight:
    """The lookups of one TBE that were marked and whose update is still to come."""

    def __init__(self) -> None:
        self._lookups: dict[int, Lookup] = {}
        self._keys = itertools.count()

    def add(self, lookup: Lookup, output: torch.Tensor) -> None:
        """Holds ``lookup`` until ``output``'s gradient is computed or ``output`` is freed."""
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return  # no backward will run, so no update either
        key = next(self._keys)
        self._lookups[key] = lookup
        output.register_hook(functools.partial(self._applied, key))
        weakref.finalize(output, self._lookups.pop, key, None)

    def _applied(self, key: int, grad: torch.Tensor) -> None:
        # The TBE's backward, and with it the row updates, runs right after this hook.
        self._lookups.pop(key, None)

    def __iter__(self):
        return iter(list(self._lookups.values()))

    def __len__(self) -> int:
        return len(self._lookups)
