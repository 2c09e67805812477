"""Training lookups whose optimizer update has not run yet.

Under FBGEMM's fused optimizers a row changes in the backward of the lookup that
read it. A pipeline that looks up batch i+1 before batch i's backward (TorchRec's
semi-synchronous ones: TrainPipelineSemiSync, and StagedTrainPipeline with an
embedding-lookup stage) can therefore have lookups marked but not yet applied
when a save clears the marks: the rows that save writes are still the old ones,
and the update that follows would be missing from the next consecutive delta.
The tracker keeps such lookups here and marks them again after every reset, so
that they stay dirty until their update has run.

A lookup leaves when autograd is about to run the backward of the TBE's output
node (and so the update), or when that node is freed without a backward. The
output tensor itself is no guide: TorchRec frees it during the forward, as soon
as the output dist has read it, while its node lives on in the graph of the loss
until that graph is run or dropped. TorchRec's comm requests hold their autograd
nodes in reference cycles, so a graph dropped without a backward goes at the next
cyclic garbage collection; until then its lookups are marked again at each reset,
which can add rows to a delta but never drop one.
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
        """Holds ``lookup`` until the backward of ``output``'s autograd node runs, or the node is freed."""
        node = output.grad_fn if isinstance(output, torch.Tensor) else None
        if node is None:
            return  # no backward will run, so no update either
        key = next(self._keys)
        self._lookups[key] = lookup
        hook = functools.partial(self._applied, key)
        node.register_prehook(hook)
        # Only the node holds the hook, so the hook is freed with the node.
        weakref.finalize(hook, self._lookups.pop, key, None)

    def _applied(self, key: int, grad_outputs: tuple) -> None:
        # The node's backward, and with it the row updates, runs right after this hook.
        self._lookups.pop(key, None)

    def __iter__(self):
        return iter(list(self._lookups.values()))

    def __len__(self) -> int:
        return len(self._lookups)
