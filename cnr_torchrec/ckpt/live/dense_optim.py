"""The dense optimizer's saved state: which form it takes, which class saved it, and how it loads back.

A checkpoint stores the dense optimizer as ``{"kind", "class", "state_dict"}``
(:class:`SavedDenseOptimizer`), in one of three forms, chosen by the optimizer's class:

* ``"torch.optim"``, a ``torch.optim.Optimizer`` that keeps torch's own ``state_dict``:
  its state is numbered by position in the param groups, and those positions change with
  the plan (a table that is data_parallel under one plan is a dense parameter there and a
  sharded one under another). The checkpoint therefore records each position's parameter
  name (``param_names``), and a restore gives every parameter the state saved under its
  own name, with the hyperparameters of the group that held it (:mod:`.dense_optim_named`).
* ``"keyed"``, a TorchRec ``KeyedOptimizer`` (``KeyedOptimizerWrapper``, ``CombinedOptimizer``
  and its other subclasses): its own ``state_dict``, keyed by the names the user gave the
  parameters, plus each group's hyperparameters under the same names. It loads by those
  names through its own ``load_state_dict`` (:mod:`.dense_optim_keyed`).
* ``"opaque"``, anything else with ``state_dict``/``load_state_dict``: stored and loaded
  through them as they are.

A restore loads only a checkpoint saved by the same class (:func:`load_dense_state`). The
by-name form is also what the DCP interop writes and reads (``by_fqn`` and ``from_fqn`` in
:mod:`.dense_optim_named`); a checkpoint imported from DCP records no class and loads into a
``torch.optim`` or a keyed optimizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cnr_torchrec.ckpt.format.bytes.payload import DTYPES, flatten_state
from cnr_torchrec.ckpt.live.dense_optim_keyed import keyed_groups, load_keyed
from cnr_torchrec.ckpt.live.dense_optim_named import RESTORE_FIX, by_fqn, load_named_state, named_state
from cnr_torchrec.errors import (
    CheckpointError,
    CnrError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)

__all__ = ["KEYED", "KINDS", "OPAQUE", "TORCH_OPTIM", "SavedDenseOptimizer", "check_dense_optimizer", "describe",
           "kind_of", "load_dense_state", "state_to_save"]


TORCH_OPTIM, KEYED, OPAQUE = "torch.optim", "keyed", "opaque"
KINDS = (TORCH_OPTIM, KEYED, OPAQUE)


@dataclass(frozen=True)
class SavedDenseOptimizer:
    """The dense optimizer state a checkpoint holds.

    Attributes:
        kind: one of :data:`KINDS`.
        cls: the qualified class name of the optimizer that saved it; None where it was not
            recorded (a checkpoint written before it was, or imported from DCP).
        state_dict: the state: :func:`named_state`'s form for ``"torch.optim"``, the keyed
            optimizer's ``state_dict()`` with ``param_groups`` for ``"keyed"``, and
            ``state_dict()`` as it was for ``"opaque"``. A tree read from a manifest holds
            it flattened (payload.flatten_state); its top-level keys are the same.
    """

    kind: str
    cls: str | None
    state_dict: Any

    def to_tree(self) -> dict[str, Any]:
        """The tree a checkpoint stores."""
        return {"kind": self.kind, "class": self.cls, "state_dict": self.state_dict}

    @classmethod
    def from_tree(cls, tree: Any, where: str) -> SavedDenseOptimizer:
        """Reads a stored tree (flattened or not), including those written before ``kind`` was recorded: the
        bare torch.optim form, and a keyed optimizer's bare ``state_dict`` (``state`` without ``param_groups``).

        Raises:
            CorruptCheckpointError: ``tree`` is of none of the forms (``where`` names it).
        """
        if isinstance(tree, Mapping) and "kind" not in tree:
            if "param_groups" in tree and "state" in tree:
                return cls(TORCH_OPTIM, None, dict(tree))
            if "state" in tree:
                return cls(KEYED, None, {k: v for k, v in tree.items() if k != "param_names"})
        elif isinstance(tree, Mapping) and set(tree) == {"kind", "class", "state_dict"}:
            kind, name, state = tree["kind"], tree["class"], tree["state_dict"]
            needs = {TORCH_OPTIM: ("state", "param_groups"), KEYED: ("state",), OPAQUE: ()}.get(kind)
            if needs is not None and (name is None or isinstance(name, str)) and (
                    not needs or (isinstance(state, Mapping) and all(k in state for k in needs))):
                return cls(kind, name, state)
        raise CorruptCheckpointError(
            f"{where}: the saved dense optimizer state is of no form this version writes or reads (expected "
            f"{{'kind': one of {list(KINDS)}, 'class', 'state_dict'}}); the manifest was edited or written by a newer "
            "version. Restore another checkpoint, or pass dense_optimizer=None to keep the optimizer fresh")

    def label(self) -> str:
        """``kind (class)`` for people, e.g. ``keyed (torchrec.optim.keyed.KeyedOptimizerWrapper)``."""
        return f"{self.kind} ({self.cls or 'class not recorded'})"

    def by_fqn(self) -> dict[str, Any] | None:
        """The state keyed by parameter name throughout (:func:`by_fqn`'s form, what DCP's ``dense_optim``
        holds); None for a form without names: ``opaque``, the torch.optim form of a build that kept no names,
        and a keyed ``state_dict`` saved without its groups."""
        sd = self.state_dict
        if self.kind == TORCH_OPTIM and "param_names" in sd:
            return by_fqn(sd)
        if self.kind == KEYED and "param_groups" in sd:
            return {"state": dict(sd["state"]), "param_groups": list(sd["param_groups"])}
        return None


def describe(tree: Any) -> dict[str, str | None] | None:
    """What a manifest's ``dense_optimizer`` tree is, from the manifest alone (no payload is read).

    Returns:
        None where the checkpoint holds no dense optimizer state, else ``{"kind", "class"}``
        (``class`` None where it was not recorded).

    Raises:
        CorruptCheckpointError: the tree is of no form this version reads.
    """
    if tree is None:
        return None
    saved = SavedDenseOptimizer.from_tree(tree, "dense_optimizer")
    return {"kind": saved.kind, "class": saved.cls}


# ---------------------------------------------------------------------- which form, checked at construction


def _keyed_optimizer_type() -> type | None:
    try:
        from torchrec.optim.keyed import KeyedOptimizer
    except ImportError:  # torchrec is a dependency; a stripped install still saves torch.optim and opaque
        return None
    return KeyedOptimizer


def kind_of(optimizer: Any) -> tuple[str, str]:
    """The form ``optimizer``'s state is saved in, and its qualified class name.

    A ``torch.optim.Optimizer`` subclass that overrides ``state_dict`` or ``load_state_dict``
    (ZeroRedundancyOptimizer, say) is ``"opaque"``: its layout is its own.
    """
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    keyed = _keyed_optimizer_type()
    if keyed is not None and isinstance(optimizer, keyed):
        return KEYED, name
    base = torch.optim.Optimizer
    if (isinstance(optimizer, base) and cls.state_dict is base.state_dict
            and cls.load_state_dict is base.load_state_dict):
        return TORCH_OPTIM, name
    return OPAQUE, name


def _sharded_leaves(obj: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, type name) of each ShardedTensor or DTensor in a state tree."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(obj, (ShardedTensor, DTensor)):
        yield path, type(obj).__name__
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _sharded_leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _sharded_leaves(v, f"{path}[{i}]")


class _DryRun:
    """A blob sink for :func:`flatten_state` that keeps nothing and checks each tensor's dtype."""

    def add(self, name: str, tensor: torch.Tensor) -> str:
        if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
            raise CheckpointError(f"its state {name} is a tensor of dtype {tensor.dtype}, which cannot be stored; "
                                  f"keep its state in one of {sorted(DTYPES)}")
        return name


def check_dense_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuses, when the Checkpointer is built, a dense optimizer whose state could not be saved or restored.

    Checks that ``optimizer`` has ``state_dict()`` and ``load_state_dict()``; that a
    torch.optim optimizer updates only the model's parameters (its state is saved by their
    names); that no parameter or state is a ShardedTensor or DTensor (rank 0 saves the
    dense optimizer whole); and that ``state_dict()`` holds only what a checkpoint stores
    (tensors of a stored dtype, numbers, strings, None, lists, tuples, dicts).

    Raises:
        ConfigError: one of these does not hold; the message says what to change.
    """
    what = type(optimizer).__name__
    if not (callable(getattr(optimizer, "state_dict", None))
            and callable(getattr(optimizer, "load_state_dict", None))):
        raise ConfigError(f"dense_optimizer (a {what}) has no state_dict()/load_state_dict(); pass a "
                          "torch.optim.Optimizer, a TorchRec KeyedOptimizer, or an object with both")
    kind, _ = kind_of(optimizer)
    params = getattr(optimizer, "params", {}) if kind == KEYED else {}
    try:
        tree = state_to_save(model, optimizer)
    except CnrError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's state_dict() raises, the Checkpointer is refused
        raise ConfigError(f"dense_optimizer.state_dict() of a {what} failed ({type(e).__name__}: {e}); pass an "
                          "optimizer whose state_dict() works before its first step") from e
    sharded = [*_sharded_leaves(dict(params), "params"), *_sharded_leaves(tree["state_dict"], "state_dict()")]
    if sharded:
        where, kind_name = sharded[0]
        raise ConfigError(
            f"dense_optimizer (a {what}) holds a {kind_name} at {where}; the Checkpointer saves the dense optimizer "
            "whole from rank 0, so pass it only dense (DDP-replicated) parameters: leave the sharded tables to the "
            "DMP's fused optimizer (e.g. filter model.named_parameters() with in_backward_optimizer_filter)")
    try:
        flatten_state(tree["state_dict"], "dense_optimizer", _DryRun(), f"the {what}'s state_dict()")
    except CheckpointError as e:
        raise ConfigError(f"dense_optimizer cannot be checkpointed: {e}") from None


def state_to_save(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The tree a checkpoint stores for ``optimizer`` (:meth:`SavedDenseOptimizer.to_tree`), holding the live
    state's tensors (the caller copies them).

    Raises:
        ConfigError: a torch.optim optimizer holds a parameter that is not the model's.
    """
    kind, name = kind_of(optimizer)
    if kind == TORCH_OPTIM:
        state = named_state(model, optimizer)
    elif kind == KEYED:
        state = {**optimizer.state_dict(), "param_groups": keyed_groups(optimizer)}
    else:
        state = optimizer.state_dict()
    return SavedDenseOptimizer(kind, name, state).to_tree()


# ---------------------------------------------------------------------- restore


def load_dense_state(model: nn.Module, optimizer: Any, saved: Any, where: str) -> None:
    """Loads a stored tree (:func:`state_to_save`'s, unflattened) into ``optimizer``, in the form it was saved in.

    Args:
        model: the model whose parameters ``optimizer`` updates.
        optimizer: the dense optimizer.
        saved: the stored tree; also the bare forms older versions wrote.
        where: the checkpoint, for messages.

    Raises:
        IncompatibleCheckpointError: another class saved it (both are named), or its state does not fit this
            optimizer's parameters (another shape, other state keys).
        CorruptCheckpointError: the tree is malformed for its form.
    """
    record = SavedDenseOptimizer.from_tree(saved, where)
    kind, name = kind_of(optimizer)
    state = record.state_dict
    if record.cls is not None and (record.kind, record.cls) != (kind, name):
        raise IncompatibleCheckpointError(
            f"{where}: the dense optimizer state was saved by a {record.cls} ({record.kind} form) and is restored "
            f"into a {name} ({kind} form); {RESTORE_FIX}")
    if record.kind != kind:
        # No class recorded: the by-name torch.optim form (a DCP import) is a keyed optimizer's form too.
        state = record.by_fqn() if (record.kind, kind) == (TORCH_OPTIM, KEYED) else None
        if state is None:
            raise IncompatibleCheckpointError(
                f"{where}: the dense optimizer state is of the {record.kind} form ({record.label()}) and cannot be "
                f"restored into a {name} ({kind} form); {RESTORE_FIX}")
    if kind == TORCH_OPTIM:
        load_named_state(model, optimizer, state, where)
    elif kind == KEYED:
        load_keyed(optimizer, state, where)
    else:
        _load_opaque(optimizer, state, name, where)


def _load_opaque(optimizer: Any, state: Any, name: str, where: str) -> None:
    try:
        optimizer.load_state_dict(state)
    except CnrError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise IncompatibleCheckpointError(
            f"{where}: {name}.load_state_dict() refused the saved dense optimizer state ({type(e).__name__}: "
            f"{e}); build it as it was built when saved, or pass dense_optimizer=None to start it fresh") from None
