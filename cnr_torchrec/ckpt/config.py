"""Checkpoint configuration: frozen dataclasses, loaded from YAML with strict checking."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import yaml

from cnr_torchrec.errors import ConfigError

__all__ = ["POLICIES", "CheckpointConfig", "QuantizationConfig", "load_config"]

Policy = Literal["full", "one_shot", "consecutive", "intermittent"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)
_MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week; also keeps timedelta() from overflowing


@dataclass(frozen=True)
class QuantizationConfig:
    """How embedding weight rows are encoded (see :func:`cnr_torchrec.quant.get_codec`).

    Attributes:
        method: ``none``, ``fp16``, ``bf16``, ``uniform_sym``, ``uniform_asym``, ``kmeans`` or ``adaptive``.
        bits: 2, 3, 4 or 8 for the quantizing methods (4 when left out); None for the others.
        params: extra codec parameters, e.g. ``{"num_bins": 25, "ratio": 0.6}`` for adaptive,
            or ``{"bias_dtype": "float16"}`` to store the row bias in 2 bytes instead of 4.
        state_dtype: how the fused optimizer's per-row state (momentum, row-wise Adagrad's
            sum of squares) is stored: ``float32`` (exact, the default), ``bfloat16`` (same
            range, 2 bytes, relative error below 0.4%) or ``float16``.
    """

    method: str = "adaptive"
    bits: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    state_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    def __post_init__(self) -> None:
        from cnr_torchrec.quant import UnknownCodecError, get_codec
        from cnr_torchrec.quant.codecs import _REGISTRY

        codec_cls = _REGISTRY.get(self.method)
        if self.bits is None and codec_cls is not None and 4 in codec_cls.bit_choices:
            object.__setattr__(self, "bits", 4)

        try:
            get_codec(self.method, self.bits, **self.params)
        except UnknownCodecError as e:
            raise ConfigError(f"quantization: {e}") from None


@dataclass(frozen=True)
class CheckpointConfig:
    """Everything a :class:`~cnr_torchrec.ckpt.Checkpointer` needs to know.

    Attributes:
        root: where checkpoints go: a directory, or any torchsnapshot storage URI
            (``fs://...``, ``s3://bucket/prefix``, or a registered plugin).
        policy: ``full`` (every checkpoint a baseline), ``one_shot`` (rows dirty since the
            baseline), ``consecutive`` (rows dirty since the previous checkpoint) or
            ``intermittent`` (one_shot, plus a new baseline when the sizes say so).
        quantization: the codec for embedding weight rows, and the precision of the
            fused optimizer's row state. Dense parameters are always stored in full precision.
        keep_last: number of chains (a baseline and the deltas that need it) kept after a commit.
        on_busy: what ``save`` does while the previous save is still writing: ``wait`` for
            it, or ``skip`` this save (the dirty rows carry over to the next one).
        full_shard_fraction: when at least this share of a table's rows is dirty, its
            shards are written whole, without row ids.
        save_timeout_s: how long rank 0 waits for every rank's report before the save fails.
        on_corrupt: what ``restore`` does when a file of the newest checkpoint fails its
            checks: ``fallback`` to the newest older checkpoint that is sound (logged), or
            ``fail`` with CorruptCheckpointError naming the file.
        storage_options: passed to the torchsnapshot storage plugin.
    """

    root: str
    policy: Policy = "consecutive"
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    keep_last: int = 2
    on_busy: Literal["wait", "skip"] = "wait"
    full_shard_fraction: float = 0.5
    save_timeout_s: float = 600.0
    on_corrupt: Literal["fail", "fallback"] = "fallback"
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.root:
            raise ConfigError("root: give the directory or storage URI where checkpoints go")
        if self.keep_last < 1:
            raise ConfigError(f"keep_last: must be at least 1 (the chain being written), got {self.keep_last}")
        if not 0.0 < self.full_shard_fraction <= 1.0:
            raise ConfigError(f"full_shard_fraction: must be in (0, 1], got {self.full_shard_fraction}")
        if not (math.isfinite(self.save_timeout_s) and 0 < self.save_timeout_s <= _MAX_TIMEOUT_S):
            raise ConfigError(
                f"save_timeout_s: must be a positive number of seconds up to {_MAX_TIMEOUT_S:.0f}, "
                f"got {self.save_timeout_s}"
            )


def load_config(source: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> CheckpointConfig:
    """Builds a :class:`CheckpointConfig` from a YAML file or a mapping.

    Args:
        source: path of a YAML file, or a mapping with the same keys.
        overrides: top-level keys that replace the file's values.

    Raises:
        ConfigError: the file is missing or not YAML, a key is unknown, a value has the
            wrong type or an inconsistent value. The message names the key.
    """
    if isinstance(source, Mapping):
        data: Any = dict(source)
        where = "config"
    else:
        where = os.fspath(source)
        try:
            with open(where) as f:
                data = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {where} does not exist; pass the path of a YAML file") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{where} is not valid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: the top level must be a mapping of config keys, got {type(data).__name__}")
    data = {**data, **overrides}
    return _build(CheckpointConfig, data, where)


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key '{key}'{hint}; valid keys are {sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in data and _required(f)]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")
    kwargs = {key: _convert(hints[key], value, f"{where}: {key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(tp, value, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {args}")
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config field type {tp} is not supported by the loader")  # a bug in this module
