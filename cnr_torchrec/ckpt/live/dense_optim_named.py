"""A ``torch.optim.Optimizer``'s state saved by parameter name, so that it follows its parameters.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in the param
groups. Those positions change with the plan: a table that is data_parallel under one plan
is a dense parameter there and a sharded one under another. The saved form therefore
records each position's parameter name (:func:`named_state`), and a restore gives every
parameter the state saved under its own name, with the hyperparameters of the group that
held it (:func:`load_named_state`). The same state keyed by name throughout (:func:`by_fqn`,
:func:`from_fqn`) is what the DCP interop writes and reads. :mod:`.dense_optim` picks this
form for torch.optim optimizers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cnr_torchrec.errors import CnrError, ConfigError, CorruptCheckpointError, IncompatibleCheckpointError

__all__ = ["RESTORE_FIX", "by_fqn", "check_shapes", "from_fqn", "load_named_state", "named_state", "param_names"]

log = logging.getLogger(__name__)

RESTORE_FIX = "build the same optimizer class as the one that saved it, or pass dense_optimizer=None to start it fresh"


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
                check_shapes(saved["state"][i], params[j], names[j], where)
                state[j] = saved["state"][i]
        # The group's hyperparameters (lr after a schedule, say) as saved, its parameters as they are now.
        groups.append({**(hyper or group), "params": group["params"]})
    dropped = sorted(set(saved_at) - set(names))
    if fresh:
        log.warning("%s: no dense optimizer state for %s; they start fresh", where, fresh)
    if dropped:
        log.info("%s: dense optimizer state of %s left out (no longer dense parameters)", where, dropped)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def check_shapes(state: Mapping[str, Any], param: torch.Tensor, name: str, where: str) -> None:
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
        groups: list[Any] = []
        names: list[Any] = []
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
