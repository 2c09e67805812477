"""The training job's YAML: the sections ``data``, ``model``, ``train`` and ``checkpoint``, strictly loaded.

``load_job_config(path, overrides)`` reads the file, applies ``--set a.b=c`` overrides (values
parsed as YAML), and builds each section with the same strict loader as the checkpoint config:
an unknown key anywhere (with a did-you-mean), a wrong type or an out-of-range value raises
ConfigError naming it. docs/train.md lists the keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.ckpt.config_loading import convert_value, dataclass_from_mapping, read_mapping
from cnr_torchrec.errors import ConfigError

from cnr_dlrm.data import DataConfig
from cnr_dlrm.dlrm import ModelConfig

__all__ = ["JobConfig", "TrainConfig", "apply_overrides", "load_job_config"]


@dataclass(frozen=True)
class TrainConfig:
    """The ``train:`` section of a job config.

    Attributes:
        steps: training steps (batches per rank) of the whole job, across restarts.
        optimizer: the dense optimizer: ``adagrad``, ``adam`` or ``sgd``.
        lr: its learning rate.
        embedding_optimizer: FBGEMM's fused optimizer for the tables: ``rowwise_adagrad``
            (EXACT_ROWWISE_ADAGRAD), ``adagrad`` or ``sgd``.
        embedding_lr: its learning rate.
        checkpoint_interval: a checkpoint every this many steps (and one at the last step), unless
            ``checkpoint.interval`` is set: then ``Checkpointer.should_save`` decides.
        eval_batches: held-out batches per rank evaluated at the end.
    """

    steps: int = 300
    optimizer: Literal["adagrad", "adam", "sgd"] = "adagrad"
    lr: float = 0.05
    embedding_optimizer: Literal["rowwise_adagrad", "adagrad", "sgd"] = "rowwise_adagrad"
    embedding_lr: float = 0.05
    checkpoint_interval: int = 50
    eval_batches: int = 10

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps: must be at least 1, got {self.steps}")
        for key in ("lr", "embedding_lr"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{key}: must be a positive number, got {v}")
        if self.checkpoint_interval < 1:
            raise ConfigError(f"checkpoint_interval: must be at least 1 step, got {self.checkpoint_interval}")
        if self.eval_batches < 1:
            raise ConfigError(f"eval_batches: must be at least 1, got {self.eval_batches}")


@dataclass(frozen=True)
class JobConfig:
    """A whole job: ``data``, ``model``, ``train`` and ``checkpoint`` (a :class:`CheckpointConfig`)."""

    checkpoint: CheckpointConfig
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


@dataclass(frozen=True)
class _Sections:
    """The top level of a job YAML; each section is checked by its own dataclass."""

    checkpoint: dict[str, Any]
    data: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


def _is_sequence_type(tp: Any) -> bool:
    return typing.get_origin(tp) in (tuple, list)


def _int_sequence(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"{where}: expected a list of integers, got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ConfigError(f"{where}: expected a list of integers, got {list(value)!r}")
    return tuple(value)


def _name_groups(value: Any, where: str) -> tuple[tuple[str, ...], ...]:
    def is_list(v: Any) -> bool:
        return isinstance(v, Sequence) and not isinstance(v, (str, bytes))

    if not is_list(value) or not all(is_list(g) and all(isinstance(n, str) for n in g) for g in value):
        raise ConfigError(f"{where}: expected a list of lists of feature names, e.g. [[cat_0, cat_1]], got {value!r}")
    return tuple(tuple(g) for g in value)


def _convert_sequence(tp: Any, value: Any, where: str) -> tuple:
    args = typing.get_args(tp)
    if args and typing.get_origin(args[0]) in (tuple, list):
        return _name_groups(value, where)
    return _int_sequence(value, where)


def _build_section(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """``ckpt.config_loading.dataclass_from_mapping`` for a section whose dataclass also has list fields.

    Same checks and messages (unknown keys with a did-you-mean, required keys, types via
    ``convert_value``); ``convert_value`` has no list type, so those fields (lists of integers, and
    lists of lists of names) are converted here.
    """
    hints = typing.get_type_hints(cls)
    if not any(_is_sequence_type(tp) for tp in hints.values()):
        return dataclass_from_mapping(cls, data, where)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key '{key}'{hint}; valid keys are {sorted(names)}")
    kwargs = {
        k: _convert_sequence(hints[k], v, f"{where}: {k}") if _is_sequence_type(hints[k])
        else convert_value(hints[k], v, f"{where}: {k}")
        for k, v in data.items()
    }
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``a.b.c=value`` applied; the value is parsed as YAML.

    Raises:
        ConfigError: an override that is not ``key.path=value``, a value that is not YAML, or a
            path through something that is not a mapping.
    """
    out = json.loads(json.dumps(data))  # a deep copy of plain YAML data
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or any(not p.strip() for p in parts):
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set train.steps=100")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from None
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(
                    f"--set {item!r}: '{'.'.join(parts[: i + 1])}' is {nxt!r}, not a section; "
                    f"it has no key '{parts[i + 1]}'"
                )
            node = nxt
        node[parts[-1].strip()] = value
    return out


def load_job_config(source: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()) -> JobConfig:
    """Builds a :class:`JobConfig` from a YAML file (or a mapping) and ``--set`` style overrides.

    Raises:
        ConfigError: a missing or invalid file, an unknown key anywhere (with a did-you-mean), a
            wrong type, an out-of-range value or a bad override. The message names the key.
    """
    data, where = read_mapping(source, "job config", empty_ok=True, by_name=False)
    if where == "config":
        where = "job config"
    data = apply_overrides(data, overrides)
    sections = dataclass_from_mapping(_Sections, data, where)
    if "checkpoint_interval" in sections.train and sections.checkpoint.get("interval") is not None:
        raise ConfigError(
            f"{where}: both train.checkpoint_interval and checkpoint.interval are set; keep one (checkpoint.interval "
            "lets the Checkpointer pick the steps, e.g. 'auto')"
        )
    return JobConfig(
        checkpoint=dataclass_from_mapping(CheckpointConfig, sections.checkpoint, f"{where}: checkpoint"),
        data=_build_section(DataConfig, sections.data, f"{where}: data"),
        model=_build_section(ModelConfig, sections.model, f"{where}: model"),
        train=_build_section(TrainConfig, sections.train, f"{where}: train"),
    )
