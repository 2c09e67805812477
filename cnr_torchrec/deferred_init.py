"""The initial values of a sharded model's tables, drawn only if a restore does not overwrite them.

DistributedModelParallel fills every TBE table with initial values twice as it builds the model: each
kernel's ``init_parameters()`` draws ``uniform_`` into its tables as it is made, and then the sharded
collection's ``reset_parameters()`` draws each table's ``init_fn`` into its local shard (and broadcasts
rank 0's data_parallel tables), which is what the tables hold. A job that restores next overwrites every
one of those rows. Built with ``CheckNRunDMP(..., will_restore=...)``, the tables are allocated as FBGEMM
allocates them (zeroed, with their optimizer state) but not filled: both calls are recorded, in order,
each with the state of the generator it draws from, and run later by :meth:`DeferredInit.materialize`.

Why this is safe:

- A restore that succeeds has written every row of every table it restores (the restore refuses a chain
  that leaves a row without a whole copy, data_parallel tables included), so the values it would have
  overwritten are never read.
- Everything else that reads the weights replays the calls first: a restore that fails or finds nothing to
  restore, one that relocates managed-collision slots (its empty slots keep their values), a save, a warm
  start, ``state_dict()`` and the first forward. (A partial recovery reloads a replaced rank's shards and
  broadcasts its data_parallel tables from a survivor, so it overwrites every row too.) They see TorchRec's
  values bit for bit as an eager build gives them: TorchRec's own methods run, in the eager build's order,
  from the generator state the eager build started them from. That state is exact when nothing else draws from
  the generator between the recorded calls (it is checked: a call whose recorded state does not follow from
  the one before it is replayed from its own state, :attr:`DeferredInit.exact` turns False and a warning says
  so).
- A collection built from a module that holds its tables' values (not on meta) loads them over the initial
  values as it is built: the calls recorded so far run just before, as they would in an eager build.
- Modules left on meta (a dense part built there) are reset by DMP after the tables, drawing where an
  eager build's tables have drawn already: the calls recorded so far run just before, so nothing is
  deferred then. TorchRec's examples build the dense part on its device, which defers everything.
- A data_parallel table's FBGEMM TBE draws its first values as it is made (``torch.randn``), between the
  recorded calls. Its draws are kept out of the generator's stream while the model is built, and at the
  replay the same constructor runs again (its result thrown away), so the calls after it start from the
  state the eager build gives them.
- The replay of a collection with data_parallel tables broadcasts rank 0's rows as the eager build does, so
  it is collective: every caller above runs on every rank at once.

What differs from an eager build: the global generator is not advanced by the draws that were skipped, so
code that draws after the model is built sees other numbers than it would otherwise (``restore_rng`` sets
the generator from the checkpoint anyway).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbedding, BaseBatchedEmbeddingBag
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel

__all__ = ["DeferredInit"]

log = logging.getLogger(__name__)

# The methods that draw a table's initial values, by the class that defines them.
_DRAWS: tuple[tuple[type, str], ...] = (
    (BaseBatchedEmbeddingBag, "init_parameters"), (BaseBatchedEmbedding, "init_parameters"),
    (ShardedEmbeddingBagCollection, "reset_parameters"), (ShardedEmbeddingCollection, "reset_parameters"),
)
# What loads values over the initial ones while the model is built (from an unsharded module not on meta).
_LOADS: tuple[tuple[type, str], ...] = (
    (ShardedEmbeddingBagCollection, "load_state_dict"), (ShardedEmbeddingCollection, "load_state_dict"),
)
# What draws after the tables while the model is built: DMP's reset of the modules left on meta (dense ones).
_DRAWS_AFTER: tuple[tuple[type, str], ...] = ((DistributedModelParallel, "_init_parameters"),)
_DENSE_TBE = DenseTableBatchedEmbeddingBagsCodegen
_PATCHING = threading.Lock()  # the recording patches TorchRec's classes: one model is built under it at a time


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.random.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.random.set_rng_state(state)


def _device_of(module: nn.Module) -> torch.device | None:
    """The device a recorded call draws on: a kernel's tables', a sharded collection's (None: nothing to draw)."""
    if isinstance(module, (BaseBatchedEmbeddingBag, BaseBatchedEmbedding)):
        weights = module.split_embedding_weights()
        return weights[0].device if weights else None
    device = getattr(module, "_device", None)
    return None if device is None or torch.device(device).type == "meta" else torch.device(device)


def _generator_of(device: torch.device) -> torch.device:
    """The device whose default generator a ``uniform_`` on ``device`` draws from (one per CUDA device)."""
    if device.type == "cuda":
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class _Pending:
    """A call that draws initial values and has not run: a kernel's ``init_parameters`` or a sharded collection's
    ``reset_parameters``, and the generator state it starts from (None: where the call recorded before it on the
    same generator ends)."""

    module: nn.Module
    init: Callable[[nn.Module], None]  # TorchRec's own method
    generator: torch.device
    state: torch.Tensor | None


class DeferredInit:
    """The calls that draw one model's initial table values and have not run yet (see the module's docstring).

    Attributes:
        exact: whether the replay gives every table the bits an eager build would (False once a call's
            recorded generator state did not follow from the one before it).
    """

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._last: dict[torch.device, torch.Tensor] = {}  # the newest recorded state, per generator
        self.exact = True

    # ------------------------------------------------------------------ recording

    @contextlib.contextmanager
    def recording(self) -> Iterator[DeferredInit]:
        """While the body builds the model, the calls that draw its tables' initial values are recorded instead of
        run."""
        with _PATCHING:
            patched = [(cls, name, name in cls.__dict__, getattr(cls, name))
                       for cls, name in (*_DRAWS, *_LOADS, *_DRAWS_AFTER, (_DENSE_TBE, "__init__"))]
            wraps = {"__init__": self._dense_tbe, "load_state_dict": self._loader, "_init_parameters": self._dense}
            for cls, name, _, method in patched:
                wrap = wraps.get(name, self._recorder)
                setattr(cls, name, wrap(method))
            try:
                yield self
            finally:
                for cls, name, own, method in patched:
                    if own:
                        setattr(cls, name, method)
                    else:  # inherited: the class's own attribute goes again
                        delattr(cls, name)

    def _recorder(self, method: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        def record(module: nn.Module) -> None:
            device = _device_of(module)
            if device is None:  # a collection on meta (nothing to draw yet), or a kernel without tables
                method(module)
                return
            self._record(module, method, _generator_of(device))

        return record

    def _loader(self, load: Callable[..., Any]) -> Callable[..., Any]:
        """A sharded collection's ``load_state_dict``: as it is built from a module that holds its tables' values
        (not on meta), TorchRec loads them over the initial ones; those are drawn first, as an eager build draws
        them, so that the loaded values win and the stream goes on as the eager build's does."""

        def load_state_dict(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            self._replay(keep_stream=True)
            return load(module, *args, **kwargs)

        return load_state_dict

    def _dense(self, init: Callable[..., Any]) -> Callable[..., Any]:
        """DMP's initialisation of what is left on meta: the modules it resets draw where an eager build's tables
        have drawn already, so the recorded calls run first (a model whose dense part is built on its device, as
        TorchRec's examples build it, leaves nothing on meta, and defers everything)."""

        def init_parameters(dmp: nn.Module, module: nn.Module) -> None:
            if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
                self._replay(keep_stream=True)
            init(dmp, module)

        return init_parameters

    def _dense_tbe(self, init: Callable[..., None]) -> Callable[..., None]:
        """FBGEMM's dense TBE constructor, its draws kept out of the stream and recorded to be drawn again."""

        def construct(tbe: nn.Module, *args: Any, **kwargs: Any) -> None:
            generator = torch.device("cpu")
            before = _generator_state(generator)
            init(tbe, *args, **kwargs)
            weights = getattr(tbe, "weights", None)
            if isinstance(weights, torch.Tensor) and weights.device.type != "cpu":
                self.exact = False  # the CUDA generator's draws cannot be told apart from others here
                log.warning("deferred initialisation: a data_parallel table on %s drew as it was made; the tables "
                            "after it may get other initial values than an eager build gives them", weights.device)
                return
            if torch.equal(_generator_state(generator), before):
                return
            _set_generator_state(generator, before)

            def draw_again(_tbe: nn.Module) -> None:
                type(tbe)(*args, **kwargs)  # the same draws, from the state the eager build made them in

            self._record(tbe, draw_again, generator, state=before)

        return construct

    def _record(self, module: nn.Module, method: Callable[[nn.Module], None], generator: torch.device,
                state: torch.Tensor | None = None) -> None:
        state = _generator_state(generator) if state is None else state
        last = self._last.get(generator)
        follows = last is not None and torch.equal(last, state)
        if last is not None and not follows:
            self.exact = False
            log.warning("deferred initialisation: something drew from the %s generator between two of TorchRec's "
                        "initialisations of the tables, so the tables of %s may get other initial values than an "
                        "eager build gives them, if they are ever initialised", generator, type(module).__name__)
        self._last[generator] = state
        self._pending.append(_Pending(module, method, generator, None if follows else state))

    # ------------------------------------------------------------------ queries

    @property
    def pending(self) -> bool:
        """Whether some table's initial values have not been drawn."""
        return bool(self._pending)

    def defers(self, tbe: nn.Module) -> bool:
        """Whether FBGEMM TBE ``tbe``'s weights still wait for their initial values."""
        return any(getattr(p.module, "emb_module", None) is tbe for p in self._pending)

    # ------------------------------------------------------------------ ends

    def materialize(self) -> None:
        """Runs every recorded call now, in the order an eager build runs them, and leaves the global generators as
        they were. Collective where a recorded collection holds data_parallel tables. Idempotent."""
        self._replay(keep_stream=False)

    def _replay(self, keep_stream: bool) -> None:
        """Runs the recorded calls. ``keep_stream``: leave the generators where the calls end (the model is still
        being built, and an eager build's stream is there now), else put them back as they were."""
        pending, self._pending = self._pending, []
        self._last = {}
        if not pending:
            return
        saved = {g: _generator_state(g) for g in {p.generator for p in pending}}
        try:
            with torch.no_grad():
                for p in pending:
                    if p.state is not None:
                        _set_generator_state(p.generator, p.state)
                    p.init(p.module)
        finally:
            for g, state in saved.items():
                if not keep_stream:
                    _set_generator_state(g, state)

    def overwritten(self) -> None:
        """A restore wrote every row of every recorded table: nothing is left to draw."""
        self._pending = []
