"""The dense optimizer's saved state: which form it takes, which class saved it, and how it loads back.

A checkpoint stores the dense optimizer as ``{"kind", "class", "state_dict"}``
(:class:`SavedDenseOptimizer`), in one of three forms, chosen by the optimizer's class:

* ``"torch.optim"``, a ``torch.optim.Optimizer`` that keeps torch's own ``state_dict``:
  its state is numbered by position in the param groups, and those positions change with
  the plan (a table that is data_parallel under one plan is a dense parameter there and a
  sharded one under another). The checkpoint therefore records each position's parameter
  name (``param_names``), and a restore gives every parameter the state saved under its
  own name, with the hyperparameters of the group that held it (:func:`load_named_state`).
* ``"keyed"``, a TorchRec ``KeyedOptimizer`` (``KeyedOptimizerWrapper``, ``CombinedOptimizer``
  and its other subclasses): its own ``state_dict``, keyed by the names the user gave the
  parameters, plus each group's hyperparameters under the same names. It loads by those
  names through its own ``load_state_dict``.
* ``"opaque"``, anything else with ``state_dict``/``load_state_dict``: stored and loaded
  through them as they are.

A restore loads only a checkpoint saved by the same class (:func:`load_dense_state`). The
by-name form is also what the DCP interop writes and reads (:func:`by_fqn`,
:func:`from_fqn`); a checkpoint imported from DCP records no class and loads into a
``torch.optim`` or a keyed optimizer.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cnr_torchrec.ckpt.format.payload import DTYPES, flatten_state
from cnr_torchrec.errors import (
    CheckpointError,
    CnrError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)

__all__ = ["KEYED", "KINDS", "OPAQUE", "TORCH_OPTIM", "SavedDenseOptimizer", "by_fqn", "check_dense_optimizer",
           "describe", "from_fqn", "kind_of", "load_dense_state", "load_named_state", "named_state", "param_names",
           "state_to_save"]

log = logging.getLogger(__name__)

TORCH_OPTIM, KEYED, OPAQUE = "torch.optim", "keyed", "opaque"
KINDS = (TORCH_OPTIM, KEYED, OPAQUE)
_FIX = "build the same optimizer class as the one that saved it, or pass dense_optimizer=None to start it fresh"


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
        state = {**optimizer.state_dict(), "param_groups": _keyed_groups(optimizer)}
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
            f"into a {name} ({kind} form); {_FIX}")
    if record.kind != kind:
        # No class recorded: the by-name torch.optim form (a DCP import) is a keyed optimizer's form too.
        state = record.by_fqn() if (record.kind, kind) == (TORCH_OPTIM, KEYED) else None
        if state is None:
            raise IncompatibleCheckpointError(
                f"{where}: the dense optimizer state is of the {record.kind} form ({record.label()}) and cannot be "
                f"restored into a {name} ({kind} form); {_FIX}")
    if kind == TORCH_OPTIM:
        load_named_state(model, optimizer, state, where)
    elif kind == KEYED:
        _load_keyed(optimizer, state, where)
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


# ---------------------------------------------------------------------- keyed form (TorchRec KeyedOptimizer)


def _keyed_groups(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyperparameters, its parameters by the optimizer's own keys (KeyedOptimizer's
    ``param_groups`` form, which it writes only when told to)."""
    key_of = {id(p): k for k, p in optimizer.params.items()}
    return [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
             "params": sorted(key_of[id(p)] for p in g["params"])} for g in optimizer.param_groups]


def _state_maps(optimizer: Any) -> list[tuple[Any, list[torch.Tensor]]]:
    """The mutable ``param -> state`` maps behind a keyed optimizer, each with the parameters it holds state
    for (a CombinedOptimizer's are its members')."""
    from torchrec.optim.keyed import CombinedOptimizer

    if isinstance(optimizer, CombinedOptimizer):
        return [pair for _, member in optimizer.optimizers for pair in _state_maps(member)]
    return [(optimizer.state, list(optimizer.params.values()))]


def _held(optimizer: Any) -> dict[int, Any]:
    """id(param) -> its live state, for each parameter the optimizer holds state for."""
    return {id(p): s for m, _ in _state_maps(optimizer) for p, s in m.items()}


def _create_missing(optimizer: Any) -> None:
    """Creates state for every parameter without one, KeyedOptimizer.init_state's way (a step with zero
    gradients), and puts back what that step changed: parameters, gradients and the state already there."""
    params = list(optimizer.params.values())
    kept = [(p, p.detach().clone(), p.grad) for p in params]
    before = {id(p): copy.deepcopy(dict(s)) for m, _ in _state_maps(optimizer) for p, s in m.items()}
    try:
        optimizer.init_state()
    finally:
        with torch.no_grad():
            for p, value, grad in kept:
                p.copy_(value)
                p.grad = grad
        for m, _ in _state_maps(optimizer):
            for p in [p for p in m if id(p) in before]:
                m[p] = before[id(p)]


def _set_present(optimizer: Any, wanted: Mapping[int, Any]) -> None:
    """Makes the optimizer hold state for exactly the parameters in ``wanted`` (id(param) -> the state to put
    back where it holds none, or None to have the optimizer create it)."""
    if any(s is None and i not in _held(optimizer) for i, s in wanted.items()):
        _create_missing(optimizer)
    for m, params in _state_maps(optimizer):
        for p in [p for p in m if id(p) not in wanted]:
            del m[p]
        for p in params:
            if wanted.get(id(p)) is not None and p not in m:
                m[p] = wanted[id(p)]


def _load_keyed(optimizer: Any, saved: Mapping[str, Any], where: str) -> None:
    """Loads the keyed form by the optimizer's own keys, through its own ``load_state_dict``.

    As in the torch.optim form, a parameter without saved state starts fresh and saved state
    of a key the optimizer does not hold is left out (both logged); each group takes the
    hyperparameters of the saved group that held its parameters. KeyedOptimizer loads only
    into state that exists, with the same parameters: state the checkpoint has and the
    optimizer lacks is created first, state it has and the checkpoint lacks is dropped.
    On failure the optimizer holds state for the parameters it held before.
    """
    try:
        state, groups = dict(saved["state"]), list(saved.get("param_groups", []))
        saved_group = {k: g for g in groups for k in g["params"]}
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: the saved keyed dense optimizer state is malformed "
                                     f"({type(e).__name__}: {e}); restore another checkpoint, or pass "
                                     "dense_optimizer=None to keep it fresh") from None
    params = dict(optimizer.params)
    keys = sorted(state.keys() & params.keys())
    for key in keys:
        _check_state(state[key], params[key], key, where)
    before = _held(optimizer)
    try:
        _set_present(optimizer, {id(params[k]): before.get(id(params[k])) for k in keys})
        _check_same_keys(_held(optimizer), state, params, keys, where)
        optimizer.load_state_dict({"state": {k: state[k] for k in keys}, "param_groups": _keyed_groups(optimizer)})
    except CnrError:
        _set_present(optimizer, before)
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        _set_present(optimizer, before)
        raise IncompatibleCheckpointError(f"{where}: {type(optimizer).__name__}.load_state_dict() refused the "
                                          f"saved dense optimizer state ({type(e).__name__}: {e}); {_FIX}") from None
    key_of = {id(p): k for k, p in params.items()}
    for group in optimizer.param_groups:
        hyper = next((saved_group[key_of[id(p)]] for p in group["params"] if key_of[id(p)] in saved_group), {})
        for k, v in hyper.items():
            if k != "params":
                group[k] = copy.deepcopy(v)  # the group's hyperparameters as saved (lr after a schedule, say)
    fresh = sorted(k for k in params if k not in state and k not in saved_group)
    dropped = sorted(set(state) - set(params))
    if fresh:
        log.warning("%s: no dense optimizer state for %s; they start fresh", where, fresh)
    if dropped:
        log.info("%s: dense optimizer state of %s left out (the optimizer does not hold them)", where, dropped)


def _check_same_keys(live: Mapping[int, Any], state: Mapping[str, Any], params: Mapping[str, torch.Tensor],
                     keys: list[str], where: str) -> None:
    for key in keys:
        have = live.get(id(params[key]))
        if have is None:
            raise IncompatibleCheckpointError(
                f"{where}: the dense optimizer makes no state for '{key}' (does it require grad?) but the "
                f"checkpoint holds some; {_FIX}")
        if set(have) != set(state[key]):
            raise IncompatibleCheckpointError(
                f"{where}: the dense optimizer keeps {sorted(have)} for '{key}' but the checkpoint holds "
                f"{sorted(state[key])}: another optimizer inside it saved it. Build it with that optimizer, or "
                "pass dense_optimizer=None to start it fresh")


def _check_state(state: Any, param: torch.Tensor, name: str, where: str) -> None:
    if not isinstance(state, Mapping):
        raise CorruptCheckpointError(f"{where}: the saved dense optimizer state of '{name}' is a "
                                     f"{type(state).__name__}, not a dict; restore another checkpoint, or pass "
                                     "dense_optimizer=None to keep it fresh")
    _check_shapes(state, param, name, where)


# ---------------------------------------------------------------------- torch.optim form


def _clean(name: str) -> str:
    # The names dense_named_state uses: no DDP / DMP wrapper prefix, no torch.compile wrapper.
    return name.removeprefix("module.").replace("._orig_mod", "")


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of ``optimizer``, in its ``state_dict()`` order.

    Raises:
        ConfigError: the optimizer holds a parameter that is not the model's.
    """
    names = {id(p): _clean(n) for n, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError(
                    f"the dense optimizer holds a parameter of shape {list(p.shape)} that is not in the model; build "
                    "it over the model's own parameters (those of the CheckNRunDMP)"
                )
            out.append(names[id(p)])
    return out


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` plus ``param_names``, the parameter behind each position."""
    state = optimizer.state_dict()
    state["param_names"] = param_names(model, optimizer)
    return state


def load_named_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any],
                     where: str) -> None:
    """Loads ``saved`` into ``optimizer`` by parameter name.

    A parameter the checkpoint has no state for keeps a fresh one, and saved state of a
    parameter the optimizer does not hold is left out; both are logged. A checkpoint
    without ``param_names`` (written before them) is loaded by position.

    Args:
        model: the model whose parameters ``optimizer`` updates.
        optimizer: the dense optimizer.
        saved: what :func:`named_state` returned at save time.
        where: the checkpoint, for messages.

    Raises:
        IncompatibleCheckpointError: a parameter's saved state has another shape, or (by
            position) the optimizer's groups do not match the checkpoint's.
        CorruptCheckpointError: the saved state is not what :func:`named_state` writes.
    """
    try:
        _load_named_state(model, optimizer, saved, where)
    except CnrError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{where}: the saved torch.optim dense optimizer state is malformed ({type(e).__name__}: {e}); "
            "restore another checkpoint, or pass dense_optimizer=None to keep it fresh"
        ) from None


def _load_named_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any],
                      where: str) -> None:
    if "param_names" not in saved:
        try:
            optimizer.load_state_dict(dict(saved))
        except ValueError as e:
            raise IncompatibleCheckpointError(
                f"{where}: the dense optimizer does not match the one saved ({e}); build it over the same "
                "parameters, or pass dense_optimizer=None to keep it fresh"
            ) from None
        return
    saved_at = {n: i for i, n in enumerate(saved["param_names"])}
    saved_group = {i: g for g in saved["param_groups"] for i in g["params"]}
    names = param_names(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    current = optimizer.state_dict()
    state: dict[int, Any] = {}
    groups = []
    fresh = []
    for group in current["param_groups"]:
        hyper = None
        for j in group["params"]:
            i = saved_at.get(names[j])
            if i is None:
                fresh.append(names[j])
                continue
            hyper = hyper or saved_group[i]
            if i in saved["state"]:
                _check_shapes(saved["state"][i], params[j], names[j], where)
                state[j] = saved["state"][i]
        # The group's hyperparameters (lr after a schedule, say) as saved, its parameters as they are now.
        groups.append({**(hyper or group), "params": group["params"]})
    dropped = sorted(set(saved_at) - set(names))
    if fresh:
        log.warning("%s: no dense optimizer state for %s; they start fresh", where, fresh)
    if dropped:
        log.info("%s: dense optimizer state of %s left out (no longer dense parameters)", where, dropped)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _check_shapes(state: Mapping[str, Any], param: torch.Tensor, name: str, where: str) -> None:
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
            raise IncompatibleCheckpointError(
                f"{where}: dense optimizer state {key!r} of '{name}' is {list(value.shape)} in the checkpoint but "
                f"the parameter is {list(param.shape)}; the model's dense part changed"
            )


def by_fqn(named: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`named_state`'s form keyed by parameter name throughout: ``{"state": {name: {...}},
    "param_groups": [{..., "params": [name, ...]}]}``."""
    names = list(named["param_names"])
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in named["param_groups"]]
    return {"state": {names[i]: dict(s) for i, s in named["state"].items()}, "param_groups": groups}


def from_fqn(state: Any, where: str) -> dict[str, Any]:
    """Inverse of :func:`by_fqn`: :func:`named_state`'s form, for :func:`load_named_state`.

    Raises:
        IncompatibleCheckpointError: ``state`` is not of :func:`by_fqn`'s form (``where`` names it).
    """
    try:
        groups, names = [], []
        for g in state["param_groups"]:
            params = [str(p) for p in g["params"]]
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(len(names), len(names) + len(params)))})
            names += params
        at = {n: i for i, n in enumerate(names)}
        return {"state": {at[n]: dict(s) for n, s in state.get("state", {}).items()}, "param_groups": groups,
                "param_names": names}
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise IncompatibleCheckpointError(
            f"{where}: not a dense optimizer state keyed by parameter name ({type(e).__name__}: {e})") from None
