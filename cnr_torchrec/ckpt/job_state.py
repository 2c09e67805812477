"""JobState: what a checkpoint saves and restores of the training job, built once by the Checkpointer.

The model, its dirty-row tracker, the dense optimizer and the application's ``extra_state`` travel
together: the save stages them (``save/staging.py``), the restore writes them back and may roll them back
(``restore/``), a compaction reads the tracker's layout (``compact/background.py``). The
:class:`~cnr_torchrec.ckpt.Checkpointer` checks its arguments, builds one :class:`JobState` and passes it
whole, so no signature carries the four loose. torchtitan keeps its job's state the same way, as one
``states`` mapping of Stateful objects.

Where this rank sits in the job (rank, world size) is not part of it: a :class:`JobState` says what is
saved, the collaborators that hold it say where. The on-disk format (``format/``) never sees one: it takes
the names and tensors the save and the restore take out of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from cnr_torchrec.deferred_init import DeferredInit
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["DenseOptimizer", "JobState", "Stateful"]


class Stateful(Protocol):
    """An object a checkpoint saves through ``state_dict()`` and restores through ``load_state_dict()``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


DenseOptimizer = Stateful
"""The optimizer of the dense (DDP) parameters: a ``torch.optim.Optimizer``, a TorchRec ``KeyedOptimizer``, or
any other Stateful object (:mod:`~cnr_torchrec.ckpt.live.dense_optim` says which form each one is saved in)."""


@dataclass(frozen=True)
class JobState:
    """What a checkpoint of this rank saves and restores, besides the embedding rows' history.

    Attributes:
        model: the sharded model (a CheckNRunDMP).
        tracker: its ``dirty_tracker``: the TBEs, their shards on this rank, the rows that changed, the
            managed-collision modules.
        dense_optimizer: the optimizer of the dense parameters, saved whole by rank 0 (None: none is saved).
        extra_state: per-rank Stateful objects (a data loader's position...), saved and restored by name.
    """

    model: nn.Module
    tracker: DirtyRowTracker
    dense_optimizer: DenseOptimizer | None = None
    extra_state: Mapping[str, Stateful] = field(default_factory=dict)

    @property
    def deferred_init(self) -> DeferredInit | None:
        """The tables' initial values the model has not drawn yet (``CheckNRunDMP(will_restore=...)``), while some
        are pending; else None."""
        deferred = getattr(self.model, "deferred_init", None)
        return deferred if isinstance(deferred, DeferredInit) and deferred.pending else None

    def init_overwritten(self) -> None:
        """A restore wrote every row of the model's tables: the initial values it deferred are never drawn."""
        deferred = self.deferred_init
        if deferred is not None:
            deferred.overwritten()
            self.materialize_init()  # draws nothing now; the model lets go of its record

    def materialize_init(self) -> None:
        """Draws the initial values the model deferred (a no-op when none are pending)."""
        materialize = getattr(self.model, "materialize_init", None)
        if materialize is not None:
            materialize()
