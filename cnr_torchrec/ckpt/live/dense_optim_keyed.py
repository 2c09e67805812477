"""A TorchRec ``KeyedOptimizer``'s state, saved and loaded by the keys it was built with.

Its own ``state_dict()`` is keyed by the names the user gave the parameters; the saved form
adds each group's hyperparameters under the same names (:func:`keyed_groups`), which a
KeyedOptimizer writes only when told to. :func:`load_keyed` loads it back through the
optimizer's own ``load_state_dict``, which loads only into state that exists, for the same
parameters: state the checkpoint has and the optimizer lacks is created first, and state it
has and the checkpoint lacks is dropped. :mod:`.dense_optim` picks this form for keyed
optimizers (``KeyedOptimizerWrapper``, ``CombinedOptimizer`` and the other subclasses).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch

from cnr_torchrec.ckpt.live.dense_optim_named import RESTORE_FIX, check_shapes
from cnr_torchrec.errors import CnrError, CorruptCheckpointError, IncompatibleCheckpointError

__all__ = ["keyed_groups", "load_keyed"]

log = logging.getLogger(__name__)


def keyed_groups(optimizer: Any) -> list[dict[str, Any]]:
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


def load_keyed(optimizer: Any, saved: Mapping[str, Any], where: str) -> None:
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
        optimizer.load_state_dict({"state": {k: state[k] for k in keys}, "param_groups": keyed_groups(optimizer)})
    except CnrError:
        _set_present(optimizer, before)
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        _set_present(optimizer, before)
        raise IncompatibleCheckpointError(
            f"{where}: {type(optimizer).__name__}.load_state_dict() refused the saved dense optimizer state "
            f"({type(e).__name__}: {e}); {RESTORE_FIX}") from None
    key_of = {id(p): k for k, p in params.items()}
    for group in optimizer.param_groups:
        hyper: dict[str, Any] = next(
            (saved_group[key_of[id(p)]] for p in group["params"] if key_of[id(p)] in saved_group), {})
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
                f"checkpoint holds some; {RESTORE_FIX}")
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
    check_shapes(state, param, name, where)
