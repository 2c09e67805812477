"""Checkpoint config: the example configs, defaults, overrides (merged into sections), and every way a config is
rejected."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from datetime import timedelta

import pytest
import yaml

from cnr_torchrec.ckpt import POLICIES, CheckpointConfig, QuantizationConfig, load_config
from cnr_torchrec.ckpt.config import DEFAULT_COMPACTION, CompactionConfig, KeepConfig
from cnr_torchrec.ckpt.config_loading import shipped_config_path
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.quant import get_codec

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
POLICY_FILES = [CONFIGS / f"{p}.yaml" for p in ("full", "one_shot", "consecutive", "intermittent")]
TOP_KEYS = {f.name for f in dataclasses.fields(CheckpointConfig)} - {"keep_last"}  # keep_last: short for keep
QUANT_KEYS = {f.name for f in dataclasses.fields(QuantizationConfig)}


def write_yaml(tmp_path: pathlib.Path, data, name: str = "c.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# ---- the example configs ---------------------------------------------------------


def test_one_example_per_policy():
    """configs/ has one example for each policy the loader accepts."""
    assert sorted(p.stem for p in POLICY_FILES) == sorted(POLICIES)
    assert all(p.is_file() for p in POLICY_FILES)


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: p.stem)
def test_example_config_loads(path):
    """Each example loads, names its own policy, and its codec is one get_codec builds."""
    cfg = load_config(path)
    assert isinstance(cfg, CheckpointConfig)
    assert cfg.policy == path.stem
    assert cfg.root.rstrip("/").endswith(path.stem)
    codec = get_codec(cfg.quantization.method, cfg.quantization.bits, **cfg.quantization.params)
    assert codec.method == cfg.quantization.method
    if cfg.policy != "full":
        assert cfg.quantization.bits is not None and cfg.quantization.bits < 32
    # The same thing loaded from the parsed mapping, and from a str path.
    assert load_config(yaml.safe_load(path.read_text())) == cfg
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: p.stem)
def test_example_config_spells_out_every_key_with_a_comment(path):
    """Every key is written explicitly, each top-level key right after a comment line."""
    raw = yaml.safe_load(path.read_text())
    assert set(raw) == TOP_KEYS
    assert set(raw["quantization"]) == QUANT_KEYS
    lines = path.read_text().splitlines()
    for key in TOP_KEYS:
        (i,) = [i for i, line in enumerate(lines) if line.startswith(f"{key}:")]
        assert lines[i - 1].lstrip().startswith("#"), f"{path.name}: no comment above {key}"


# ---- defaults, round trips, overrides --------------------------------------------


def test_defaults():
    """A config with only a root gets the documented defaults, as written: the ones the job decides are left for
    the Checkpointer to settle (test_config_resolve.py)."""
    cfg = load_config({"root": "/ckpt"})
    assert cfg == CheckpointConfig(root="/ckpt")
    assert (cfg.policy, cfg.retention, cfg.on_busy, cfg.full_shard_fraction, cfg.save_timeout_s) == (
        "consecutive", KeepConfig(checkpoints=2), "wait", 0.5, 600.0)
    assert cfg.compaction is DEFAULT_COMPACTION == CompactionConfig(max_chain=8)  # a consecutive chain's bound
    # Left at the default under another policy it is no request (the Checkpointer runs none); asked for, refused.
    assert load_config({"root": "/ckpt", "policy": "full"}).compaction is DEFAULT_COMPACTION
    assert load_config({"root": "/ckpt", "compaction": None}).compaction is None
    with pytest.raises(ConfigError, match="compaction needs policy consecutive"):
        load_config({"root": "/ckpt", "policy": "full", "compaction": {"max_chain": 16}})
    assert cfg.quantization == QuantizationConfig(method="adaptive", bits=None, params={}, residual="auto")
    assert cfg.quantization.bits_or_default == 4 and cfg.failure.bits_table is None
    assert cfg.storage_options == {}


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: p.stem)
def test_round_trip_through_yaml(path, tmp_path):
    """asdict -> YAML -> load_config gives back an equal config."""
    cfg = load_config(path)
    again = load_config(write_yaml(tmp_path, dataclasses.asdict(cfg)))
    assert again == cfg
    assert load_config(dataclasses.asdict(cfg)) == cfg


def test_round_trip_of_defaults(tmp_path):
    cfg = CheckpointConfig(root="s3://bucket/prefix")
    assert load_config(write_yaml(tmp_path, dataclasses.asdict(cfg))) == cfg


def test_int_is_accepted_for_float_fields():
    cfg = load_config({"root": "/r", "full_shard_fraction": 1, "save_timeout_s": 30})
    assert cfg.full_shard_fraction == 1.0 and type(cfg.full_shard_fraction) is float
    assert cfg.save_timeout_s == 30.0 and type(cfg.save_timeout_s) is float


def test_overrides_replace_file_values(tmp_path):
    path = POLICY_FILES[1]  # one_shot
    base = load_config(path)
    cfg = load_config(path, policy="full", keep={"checkpoints": 7}, root=str(tmp_path),
                      quantization=QuantizationConfig(method="uniform_sym", bits=8))
    assert (cfg.policy, cfg.retention, cfg.root) == ("full", KeepConfig(checkpoints=7), str(tmp_path))
    with pytest.raises(ConfigError, match="give keep_last or keep, not both"):
        load_config(path, keep_last=3)
    # residual: auto stays as written; under policy full the config decides it is plain coding.
    assert cfg.quantization == QuantizationConfig(method="uniform_sym", bits=8, params={}, residual="auto")
    assert cfg.residual_from_config is False
    # Everything not overridden comes from the file.
    assert (cfg.on_busy, cfg.full_shard_fraction, cfg.save_timeout_s, cfg.storage_options) == (
        base.on_busy, base.full_shard_fraction, base.save_timeout_s, base.storage_options)


SHIPPED = yaml.safe_load(pathlib.Path(shipped_config_path("consecutive")).read_text())


@pytest.mark.parametrize("section,override", [
    ("quantization", {"bits": 8}),
    ("quantization", {"state_dtype": "float32"}),
    ("keep", {"bytes": 10**9}),
    ("compaction", {"max_chain": 4}),
])  # (the shipped failure and budget sections hold the defaults: a merge there looks like a replacement)
def test_a_section_override_merges_into_the_shipped_section(section, override):
    """``load_config("consecutive", quantization={"bits": 8})`` changes the bits and keeps every other key of
    the shipped file's quantization section (its method, params, state_dtype, residual), as written in the file."""
    assert set(override) < set(SHIPPED[section]), "the override must leave some of the file's keys to keep"
    cfg = load_config("consecutive", root="/r", **{section: override})
    got = getattr(cfg, section)
    for key, value in {**SHIPPED[section], **override}.items():
        assert getattr(got, key) == value, f"{section}.{key}"
    # Nothing else moved: the same as the file with that one key edited.
    edited = {**SHIPPED, "root": "/r", section: {**SHIPPED[section], **override}}
    assert cfg == load_config(edited)


def test_the_shipped_values_that_a_merge_keeps_are_not_the_defaults():
    """The merge test above can fail: the shipped quantization differs from the dataclass's defaults in the
    keys the override leaves alone, so a replaced section would not pass for a merged one."""
    merged = load_config("consecutive", root="/r", quantization={"bits": 8}).quantization
    replaced = load_config("consecutive", root="/r", quantization=QuantizationConfig(bits=8)).quantization
    assert merged.params == SHIPPED["quantization"]["params"] != replaced.params == {}
    assert merged.state_dtype == SHIPPED["quantization"]["state_dtype"] != replaced.state_dtype == "float32"


def test_a_dataclass_replaces_a_section_whole():
    cfg = load_config("consecutive", root="/r", quantization=QuantizationConfig(method="uniform_sym", bits=8),
                      compaction=CompactionConfig(max_chain=4))
    assert cfg.quantization == QuantizationConfig(method="uniform_sym", bits=8)
    assert cfg.compaction == CompactionConfig(max_chain=4)  # the file's max_chain_bytes_ratio: 1.0 is gone
    assert SHIPPED["compaction"]["max_chain_bytes_ratio"] is not None


def test_none_turns_an_optional_section_off_and_a_dict_field_is_replaced():
    cfg = load_config("consecutive", root="/r", compaction=None,
                      quantization={"params": {"num_bins": 10}}, storage_options={"anon": True})
    assert cfg.compaction is None
    # A codec's parameters go together: the file's ratio and bias_dtype are not mixed into new params.
    assert cfg.quantization.params == {"num_bins": 10}
    assert cfg.quantization.state_dtype == SHIPPED["quantization"]["state_dtype"]
    assert cfg.storage_options == {"anon": True}


def test_a_section_override_onto_a_null_section():
    """full.yaml has ``compaction: null``: a mapping then gives the section, with nothing to merge."""
    cfg = load_config("full", root="/r", policy="consecutive", compaction={"max_chain": 4})
    assert cfg.compaction == CompactionConfig(max_chain=4)


def test_a_merge_that_conflicts_says_how_to_replace_the_section():
    """Another method under the file's adaptive params: the error names the kept key and the way out; an
    override whose own keys are wrong gets no such hint."""
    with pytest.raises(ConfigError) as e:
        load_config("consecutive", root="/r", quantization={"method": "uniform_sym"})
    assert "num_bins" in str(e.value) and "quantization=QuantizationConfig(...)" in str(e.value)
    assert "with overrides ['quantization', 'root']" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("consecutive", root="/r", quantization={"bit": 8})
    assert "did you mean 'bits'" in str(e.value) and "QuantizationConfig(...)" not in str(e.value)
    with pytest.raises(ConfigError, match="expected a mapping or a QuantizationConfig"):
        load_config("consecutive", root="/r", quantization=KeepConfig(checkpoints=3))


def test_nested_overrides_modify_neither_source():
    src = {"root": "/r", "quantization": {"method": "adaptive", "params": {"num_bins": 25}}}
    override = {"bits": 8, "params": {"ratio": 0.5}}
    load_config(src, quantization=override)
    assert src == {"root": "/r", "quantization": {"method": "adaptive", "params": {"num_bins": 25}}}
    assert override == {"bits": 8, "params": {"ratio": 0.5}}


def test_overrides_on_a_mapping_and_missing_root():
    assert load_config({"policy": "full"}, root="/x") == CheckpointConfig(root="/x", policy="full")


def test_overrides_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="keep_last: expected an integer"):
        load_config(POLICY_FILES[0], keep_last="3")
    with pytest.raises(ConfigError, match=r"unknown key 'keep_lats' \(did you mean 'keep_last'\?\)"):
        load_config(POLICY_FILES[0], keep_lats=3)


def test_mapping_source_is_not_modified():
    src = {"root": "/r", "keep_last": 3}
    load_config(src, keep_last=4)
    assert src == {"root": "/r", "keep_last": 3}


def test_frozen():
    """Neither the config nor its quantization part can be changed after loading."""
    cfg = load_config({"root": "/r"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.keep_last = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "full"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.quantization.bits = 8
    assert cfg == CheckpointConfig(root="/r")


# ---- errors ------------------------------------------------------------------------

BAD_VALUES = [
    # (key path, value, fragments the message must contain)
    ("root", 5, ["root", "expected a string"]),
    ("root", None, ["root", "expected a string"]),
    ("root", "", ["root"]),
    ("policy", "differential", ["policy", "'differential'", "one_shot"]),
    ("policy", "Full", ["policy", "'Full'"]),
    ("policy", 1, ["policy"]),
    ("on_busy", "block", ["on_busy", "'block'", "skip"]),
    ("on_busy", True, ["on_busy"]),
    ("keep_last", "2", ["keep_last", "expected an integer", "'2'"]),
    ("keep_last", True, ["keep_last", "expected an integer", "True"]),
    ("keep_last", 2.0, ["keep_last", "expected an integer"]),
    ("keep_last", 0, ["keep_last", "at least 1", "got 0"]),
    ("keep_last", -3, ["keep_last", "at least 1", "got -3"]),
    ("full_shard_fraction", "0.5", ["full_shard_fraction", "expected a number"]),
    ("full_shard_fraction", False, ["full_shard_fraction", "expected a number"]),
    ("full_shard_fraction", 0, ["full_shard_fraction", "(0, 1]"]),
    ("full_shard_fraction", -0.25, ["full_shard_fraction", "(0, 1]"]),
    ("full_shard_fraction", 1.0001, ["full_shard_fraction", "(0, 1]"]),
    ("full_shard_fraction", float("nan"), ["full_shard_fraction", "(0, 1]"]),
    ("save_timeout_s", "10", ["save_timeout_s", "expected a number"]),
    ("save_timeout_s", True, ["save_timeout_s", "expected a number"]),
    ("save_timeout_s", 0, ["save_timeout_s", "positive"]),
    ("save_timeout_s", -1.5, ["save_timeout_s", "positive"]),
    ("storage_options", ["a"], ["storage_options", "expected a mapping"]),
    ("storage_options", "anon=true", ["storage_options", "expected a mapping"]),
    ("quantization", 4, ["quantization", "expected a mapping"]),
    ("quantization", None, ["quantization", "expected a mapping"]),
    ("quantization.method", "zstd", ["quantization", "zstd"]),
    ("quantization.method", 3, ["quantization", "method", "expected a string"]),
    ("quantization.bits", 5, ["quantization", "bits=5"]),
    ("quantization.bits", "4", ["quantization", "bits", "expected an integer"]),
    ("quantization.bits", True, ["quantization", "bits", "expected an integer"]),
    ("quantization.params", {"num_bins": 0}, ["quantization", "num_bins"]),
    ("quantization.params", {"ratio": 1.5}, ["quantization", "ratio"]),
    ("quantization.params", {"iters": 3}, ["quantization", "'iters'"]),
    ("quantization.params", [1], ["quantization", "params", "expected a mapping"]),
]


def _set(data: dict, key: str, value) -> dict:
    data = {**data, "quantization": dict(data["quantization"])}
    if key.startswith("quantization."):
        data["quantization"][key.split(".", 1)[1]] = value
    else:
        data[key] = value
    return data


@pytest.mark.parametrize("key,value,fragments", BAD_VALUES, ids=lambda x: repr(x) if not isinstance(x, list) else "")
def test_bad_value_names_the_key(key, value, fragments, tmp_path):
    """Each bad value raises ConfigError naming the key, from a mapping and from a YAML file."""
    good = dataclasses.asdict(load_config(POLICY_FILES[3]))
    data = _set(good, key, value)
    with pytest.raises(ConfigError) as e:
        load_config(data)
    for fragment in fragments:
        assert fragment in str(e.value)
    path = write_yaml(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    for fragment in fragments + [str(path)]:
        assert fragment in str(e.value)


def test_missing_root():
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['root'\]"):
        load_config({"policy": "full"})


@pytest.mark.parametrize("typo,meant", [("polcy", "policy"), ("keeplast", "keep_last"), ("on-busy", "on_busy"),
                                        ("save_timeout", "save_timeout_s"), ("quantisation", "quantization")])
def test_typo_gives_did_you_mean(typo, meant):
    with pytest.raises(ConfigError) as e:
        load_config({"root": "/r", typo: None})
    msg = str(e.value)
    assert f"unknown key '{typo}'" in msg
    assert f"(did you mean '{meant}'?)" in msg
    assert str(sorted(TOP_KEYS | {"keep_last"})) in msg


def test_typo_in_quantization_gives_did_you_mean():
    with pytest.raises(ConfigError) as e:
        load_config({"root": "/r", "quantization": {"method": "adaptive", "bit": 4}})
    msg = str(e.value)
    assert "quantization" in msg and "unknown key 'bit'" in msg and "(did you mean 'bits'?)" in msg


def test_unknown_key_without_a_close_match():
    with pytest.raises(ConfigError) as e:
        load_config({"root": "/r", "zzzzzz": 1})
    assert "unknown key 'zzzzzz'" in str(e.value) and "did you mean" not in str(e.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as e:
        load_config(path)
    assert str(path) in str(e.value)


def test_invalid_yaml(tmp_path):
    path = write_yaml(tmp_path, "root: /r\npolicy: [full\n")
    with pytest.raises(ConfigError, match="is not valid YAML") as e:
        load_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("text,kind", [("- root: /r\n", "list"), ("just a string\n", "str"), ("", "NoneType"),
                                       ("42\n", "int")])
def test_top_level_must_be_a_mapping(text, kind, tmp_path):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError, match=f"top level must be a mapping.*got {kind}") as e:
        load_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e20])
def test_accepted_timeout_is_usable(value):
    """A save_timeout_s the loader accepts must be one the checkpointer can turn into a timedelta
    (checkpointer.py does ``timedelta(seconds=config.save_timeout_s)`` on every multi-rank save)."""
    try:
        cfg = load_config({"root": "/r", "save_timeout_s": value})
    except ConfigError as e:
        assert "save_timeout_s" in str(e)
        return
    assert not math.isnan(cfg.save_timeout_s)
    assert timedelta(seconds=cfg.save_timeout_s) > timedelta(0)


# ---- retention and compaction ---------------------------------------------------------


def test_keep_last_is_short_for_keep_checkpoints():
    assert load_config({"root": "/r", "keep_last": 5}).retention == KeepConfig(checkpoints=5)
    cfg = load_config({"root": "/r", "keep": {"bytes": 10**9, "chains": 1}})
    assert cfg.retention == KeepConfig(bytes=10**9, chains=1)


@pytest.mark.parametrize("keep,words", [
    ({}, ["keep: give checkpoints, bytes or chains"]),
    ({"checkpoints": 0}, ["keep.checkpoints", "at least 1", "got 0"]),
    ({"bytes": -5}, ["keep.bytes", "at least 1"]),
    ({"checkpoint": 3}, ["unknown key 'checkpoint'", "did you mean 'checkpoints'"]),
])
def test_bad_keep_is_named(keep, words):
    with pytest.raises(ConfigError) as e:
        load_config({"root": "/r", "keep": keep})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_compaction_config():
    cfg = load_config({"root": "/r", "compaction": {"max_chain": 8}})
    assert cfg.compaction == CompactionConfig(max_chain=8)
    assert cfg.compaction.due(7, 100, 10) == "" and "8 deltas" in cfg.compaction.due(8, 100, 10)
    ratio = CompactionConfig(max_chain_bytes_ratio=0.5)
    assert ratio.due(3, 100, 49) == "" and "0.50x the baseline" in ratio.due(3, 100, 50)


@pytest.mark.parametrize("data,words", [
    ({"compaction": {}}, ["compaction: give max_chain"]),
    ({"compaction": {"max_chain": 0}}, ["compaction.max_chain", "at least 1"]),
    ({"compaction": {"max_chain_bytes_ratio": float("nan")}}, ["max_chain_bytes_ratio", "positive"]),
    ({"compaction": {"max_chain": 4}, "policy": "intermittent"}, ["compaction needs policy consecutive"]),
])
def test_bad_compaction_is_named(data, words):
    with pytest.raises(ConfigError) as e:
        load_config({"root": "/r", **data})
    assert all(w in str(e.value) for w in words), str(e.value)
