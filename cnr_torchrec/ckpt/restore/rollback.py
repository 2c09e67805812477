"""What a restore may overwrite, copied to host memory first, so that a failed restore can put it back.

A restore writes the optimizer states of the rows as their bytes land, then the dense
parameters, the optimizers and per-rank state; a file that fails its checks half way (or a
storage error) would otherwise leave the model a mix of what it was and what the checkpoint
holds. A :class:`Snapshot` is taken before the first attempt and put back if no attempt
succeeds, so that a failed :meth:`~cnr_torchrec.ckpt.Checkpointer.restore` leaves every table,
optimizer state, dense parameter, eviction window and stateful object exactly as it found them.

Float32 host weights are not copied: the restore writes none of them before every rank has succeeded
(:class:`~cnr_torchrec.ckpt.restore.host_copies.StagedWeights`): a plain chain reads and checks every row
first and decodes in place then; a residual chain adds up into host copies of its own and copies them in
then (with residual coding that copy becomes the reconstruction, so it costs nothing extra). The
rest (fused optimizer states, weights on a GPU or of another dtype) costs one host copy for
the length of the restore (``restore_rollback: false`` in the config does without both).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cnr_torchrec.ckpt.live.dense_optim import load_dense_state, state_to_save
from cnr_torchrec.ckpt.live.dense_params import dense_named_state
from cnr_torchrec.ckpt.live.rng import rng_state, set_rng_state
from cnr_torchrec.ckpt.restore.host_copies import can_stage
from cnr_torchrec.deferred_init import DeferredInit
from cnr_torchrec.track import DirtyRowTracker
from cnr_torchrec.track.tbe_cache import invalidate_caches
from cnr_torchrec.track.torchrec_types import TorchRecModule

__all__ = ["Snapshot"]

log = logging.getLogger(__name__)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


@dataclass
class Snapshot:
    """A copy of everything a restore of this rank may write, and the live tensors to write it back to."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live, its copy)
    mc: list[tuple[Any, Any]] = field(default_factory=list)  # (McTable, what McTable.capture() gave)
    stateful: list[tuple[Any, Any]] = field(default_factory=list)  # (object with load_state_dict, its state)
    dense_optimizer: tuple[nn.Module, Any, Any] | None = None  # (model, optimizer, its saved form)
    rng: dict[str, Any] | None = None
    tbes: list[TorchRecModule] = field(default_factory=list)

    @classmethod
    def take(cls, *, model: nn.Module, tracker: DirtyRowTracker, dense_optimizer: Any,
             extra_state: Mapping[str, Any], rng: bool, deferred: DeferredInit | None = None) -> Snapshot:
        """Copies what a restore onto ``model`` may change.

        Args:
            model: the CheckNRunDMP.
            tracker: its tracker: the TBEs (weights, optimizer states, step counter) and managed-collision modules.
            dense_optimizer: its ``state_dict()`` is deep-copied (None: nothing to copy).
            extra_state: each object's ``state_dict()`` is deep-copied.
            rng: also copy the global RNG states (the restore sets them).
            deferred: the model's tables whose initial values are not drawn yet (``will_restore``): their
                weights are not copied, since a failed restore draws those values instead.
        """
        snap = cls(tbes=list(tracker.tbes()))
        # The caller wrote every cache back first (Restorer.run): the rows copied here are the newest.
        for tbe in snap.tbes:
            # Weights a staged restore writes into host copies never change before its commit: no copy needed.
            unset = deferred is not None and deferred.defers(tbe)
            views = [] if unset else [w for w in tbe.split_embedding_weights() if not can_stage(w)]
            if hasattr(tbe, "split_optimizer_states"):
                views += [s for states in tbe.split_optimizer_states() for s in states]
            it = getattr(tbe, "iter", None)
            if isinstance(it, torch.Tensor):
                views.append(it)
            snap.tensors += [(v, _host_copy(v)) for v in views if v.numel()]
        snap.tensors += [(t, _host_copy(t)) for t in dense_named_state(model, tracker.module_fqns()).values()]
        snap.mc = [(mc, mc.capture()) for mc in tracker.mc_tables().values()]
        if dense_optimizer is not None:  # the form a checkpoint stores: a keyed optimizer loads only into it
            snap.dense_optimizer = (model, dense_optimizer, copy.deepcopy(state_to_save(model, dense_optimizer)))
        snap.stateful = [(obj, copy.deepcopy(obj.state_dict())) for obj in extra_state.values()]
        snap.rng = rng_state() if rng else None
        return snap

    @property
    def nbytes(self) -> int:
        """The host memory the tensors' copies take."""
        return sum(c.numel() * c.element_size() for _, c in self.tensors)

    def put_back(self) -> None:
        """Writes every copy back where it came from. A rank's own: it makes no collective call."""
        with torch.no_grad():
            for live, saved in self.tensors:
                live.copy_(saved)
        invalidate_caches(self.tbes)  # lines a failed attempt may have left are stale now
        for mc, captured in self.mc:
            mc.put_back(captured)
        if self.dense_optimizer is not None:
            model, optimizer, saved = self.dense_optimizer
            load_dense_state(model, optimizer, copy.deepcopy(saved), "putting back the state a failed restore changed")
        for obj, state in self.stateful:
            obj.load_state_dict(copy.deepcopy(state))
        if self.rng is not None:
            set_rng_state(self.rng)
