"""Strict, typed loading of config dataclasses from YAML files or mappings.

Every config section of the library is a frozen dataclass whose fields are annotated with
plain types; this module builds one from what YAML gives, checking as it goes. An unknown key
is refused with the closest valid one, a missing required key is named, and a value of the
wrong type is refused rather than coerced (only an integer is taken for a float). Each error
message starts with where the value was (the file and the key path), so a typo in a nested
section points at itself.

A bare name (a ``str`` with no path separator that does not end in ``.yaml`` or ``.yml``) is
one of the configs the package ships, ``cnr_torchrec/configs/NAME.yaml``: ``load_config("consecutive")``
works wherever the package is installed. Anything else is a path, relative to the working directory.

Keyword overrides (``load_config("consecutive", quantization={"bits": 8})``) are laid over what the
file gives by :func:`merge_overrides`: an override of a section merges into the file's section, key
by key, and an instance of the section's dataclass replaces it whole.

It knows nothing of checkpoints' fields: :func:`cnr_torchrec.ckpt.config.load_config` builds a
:class:`~cnr_torchrec.ckpt.config.CheckpointConfig` with it, and the training job's config
(``cnr_dlrm.config``) builds its sections with it, so both report errors alike.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import yaml

from cnr_torchrec.errors import ConfigError

__all__ = [
    "convert_value",
    "dataclass_from_mapping",
    "dataclass_with_overrides",
    "is_config_name",
    "merge_overrides",
    "read_mapping",
    "shipped_config_names",
    "shipped_config_path",
]

_SHIPPED_SUFFIX = ".yaml"


def _shipped_dir() -> Any:
    # Through importlib.resources, so that the package's own files are found wherever it is installed.
    return importlib.resources.files("cnr_torchrec").joinpath("configs")


def shipped_config_names() -> list[str]:
    """The names of the configs the package ships, sorted (each one's file is ``cnr_torchrec/configs/NAME.yaml``)."""
    folder = _shipped_dir()
    if not folder.is_dir():
        return []
    return sorted(f.name[: -len(_SHIPPED_SUFFIX)] for f in folder.iterdir() if f.name.endswith(_SHIPPED_SUFFIX))


def is_config_name(source: Any) -> bool:
    """Whether ``source`` names a shipped config rather than a file: a ``str`` with no path separator
    that does not end in ``.yaml`` or ``.yml`` (a :class:`os.PathLike` is always a path)."""
    if not isinstance(source, str):
        return False
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    return not any(sep in source for sep in separators) and not source.endswith((".yaml", ".yml"))


def shipped_config_path(name: str) -> str:
    """The file of the shipped config ``name``.

    Args:
        name: one of :func:`shipped_config_names`, such as ``"consecutive"``.

    Returns:
        The path of ``cnr_torchrec/configs/<name>.yaml`` in the installed package.

    Raises:
        ConfigError: no shipped config has that name; the message lists those that do.
    """
    names = shipped_config_names()
    if name not in names:
        raise ConfigError(
            f"{name!r} is not a config the package ships; the shipped configs are {names}. "
            f"To read a file, pass its path (such as ./{name} or {name}.yaml)"
        )
    return os.fspath(_shipped_dir().joinpath(name + _SHIPPED_SUFFIX))


def read_mapping(
    source: str | os.PathLike | Mapping[str, Any], what: str, empty_ok: bool = False, *, by_name: bool = True
) -> tuple[dict[str, Any], str]:
    """The top-level mapping of a YAML file (or a mapping, copied), and how to name it in errors.

    An empty file is an empty mapping when ``empty_ok`` (every key has a default), else an error.

    Args:
        source: a mapping, the path of a YAML file, or (with ``by_name``) the name of a shipped config.
        what: what the file is, for errors ("config file").
        empty_ok: an empty file is an empty mapping instead of an error.
        by_name: read a bare name (see :func:`is_config_name`) as a shipped config's name; without it,
            every ``str`` is a path.

    Raises:
        ConfigError: the file is missing, is not YAML, or its top level is not a mapping; or a bare
            name that no shipped config has (the message lists the shipped names).
    """
    if isinstance(source, Mapping):
        return dict(source), "config"
    where = shipped_config_path(source) if by_name and isinstance(source, str) and is_config_name(source) \
        else os.fspath(source)
    try:
        with open(where) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} {where} does not exist; pass the path of a YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {e}") from None
    if data is None and empty_ok:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: the top level must be a mapping of config keys, got {type(data).__name__}")
    return dict(data), where


def dataclass_from_mapping(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """An instance of the config dataclass ``cls`` from the keys of ``data``, each converted to its field's type.

    Args:
        cls: a dataclass whose fields are typed with what :func:`convert_value` knows.
        data: the section's keys, as read from YAML.
        where: how errors name the section (a file and a key path).

    Raises:
        ConfigError: an unknown key (with the closest valid one), a missing required key, or a value
            of the wrong type; the message starts with ``where``.
    """
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
    kwargs = {key: convert_value(hints[key], value, f"{where}: {key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _section_type(tp: Any) -> type | None:
    """The config dataclass of a field typed ``tp`` (``X`` or ``X | None``); None for any other field."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        sections = [a for a in typing.get_args(tp) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        return sections[0] if len(sections) == 1 else None
    return None


def _section_items(value: Any) -> Mapping[str, Any] | None:
    """A section's keys as given: a mapping as it is, a dataclass instance as its fields; None for anything else."""
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return None


def merge_overrides(cls: type, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (a config's keys, as read from a file) with ``overrides`` laid over it, section by section.

    An override of a section (a field of ``cls`` typed with a config dataclass, such as
    ``quantization``, ``keep`` or ``compaction``) that is a mapping merges into the base's section,
    recursively: the keys it names replace the base's, and the section's other keys keep the base's
    values. Every other override replaces the base's value whole:

    - an instance of the section's dataclass (``QuantizationConfig(method="fp16")``): the way to
      replace a section whole, dropping every key of the base's section;
    - None, which turns off an optional section (``compaction=None``);
    - a value of a field that is not a section, a plain ``dict`` field included
      (``quantization.params``, ``storage_options``, ``failure.bits_table``): its keys belong
      together (codec parameters of one method, one bits table), so a new one is never mixed
      with the base's.

    Neither ``base`` nor ``overrides`` is modified. Keys that ``cls`` does not have are kept, for
    :func:`dataclass_from_mapping` to name.

    Args:
        cls: the config dataclass the merged keys are for (its field types decide what merges).
        base: the keys from the file or mapping.
        overrides: the keys that replace or merge into them.

    Returns:
        A new mapping of the merged keys.
    """
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    merged = dict(base)
    for key, value in overrides.items():
        section = _section_type(hints[key]) if key in hints else None
        below = _section_items(merged.get(key))
        if section is not None and isinstance(value, Mapping) and below is not None:
            merged[key] = merge_overrides(section, below, value)
        else:
            merged[key] = value
    return merged


def dataclass_with_overrides(cls: type, data: Mapping[str, Any], overrides: Mapping[str, Any], where: str) -> Any:
    """:func:`dataclass_from_mapping` of ``data`` with ``overrides`` merged over it (:func:`merge_overrides`).

    Args:
        cls: the config dataclass.
        data: the keys from the file or mapping.
        overrides: keys laid over them; none gives ``dataclass_from_mapping(cls, data, where)``.
        where: how errors name the file; ``(with overrides [...])`` is added when there are some.

    Returns:
        An instance of ``cls``.

    Raises:
        ConfigError: as :func:`dataclass_from_mapping`. When an override of a section is sound alone
            but not with the keys the file's section kept (``quantization={"method": "uniform_sym"}``
            under the file's adaptive ``params``), the message also says how to replace the section whole.
    """
    if not overrides:
        return dataclass_from_mapping(cls, data, where)
    try:
        return dataclass_from_mapping(cls, merge_overrides(cls, data, overrides), f"{where} (with overrides "
                                      f"{sorted(overrides)})")
    except ConfigError as e:
        hints = typing.get_type_hints(cls)
        for key, value in overrides.items():
            section = _section_type(hints[key]) if key in hints else None
            if section is None or not isinstance(value, Mapping) or _section_items(data.get(key)) is None:
                continue  # not merged
            if f": {key}" not in str(e):
                continue
            try:
                dataclass_from_mapping(section, value, key)
            except ConfigError:
                continue  # the override's own keys are wrong, and the message says so already
            raise ConfigError(
                f"{e}. The override of {key} was merged into the {key} section of {where}, whose other keys "
                f"were kept; to replace the section whole, pass {key}={section.__name__}(...), or override the "
                "conflicting key too"
            ) from None
        raise


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def convert_value(tp: Any, value: Any, where: str) -> Any:
    """``value`` as the annotated type ``tp``: a nested config dataclass (from a mapping, or an instance
    of it, taken as it is), a Literal, a union, a tuple of one type (from a list), a dict, a bool, int,
    float or str (an int is taken
    for a float, nothing else is coerced).

    Raises:
        ConfigError: ``value`` is not of ``tp``; the message starts with ``where``.
    """
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # built, and checked, by its own __post_init__
            return value
        if not isinstance(value, Mapping) and hasattr(tp, "from_scalar"):  # a section with a one-word form
            return tp.from_scalar(value, where)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping or a {tp.__name__}, got {value!r}")
        return dataclass_from_mapping(tp, value, where)
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
                return convert_value(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{where}: expected {' or '.join(_describe(a) for a in args)}, got {value!r}")
    if origin is tuple and len(typing.get_args(tp)) == 2 and typing.get_args(tp)[1] is Ellipsis:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(convert_value(typing.get_args(tp)[0], v, f"{where}[{i}]") for i, v in enumerate(value))
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
    raise TypeError(f"config field type {tp} is not supported by the loader")  # a library bug, not a bad file
