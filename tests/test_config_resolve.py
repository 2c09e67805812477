"""The config a user builds is what they wrote; the Checkpointer runs with it resolved (``config_resolve.resolve``):
``quantization.bits``, ``compaction``, ``quantization.residual: auto`` and ``failure.bits_table`` settled for the
job, to the values the config used to write into itself."""

from __future__ import annotations

import copy

import pytest
import torch
from _toy import build_dmp, train
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from cnr_torchrec import Checkpointer, load_config
from cnr_torchrec.ckpt.config import (
    DEFAULT_BITS_TABLE,
    DEFAULT_COMPACTION,
    RESIDUAL_BITS_TABLE,
    CheckpointConfig,
    CompactionConfig,
)
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _resolve(config, fused=EmbOptimType.EXACT_ROWWISE_ADAGRAD):
    from cnr_torchrec.ckpt._collective import Ranks
    from cnr_torchrec.ckpt.config_resolve import resolve

    dmp, _ = build_dmp(_specs(), fused=fused)
    return resolve(config, dmp.dirty_tracker, Ranks())


@pytest.mark.parametrize("policy", ["consecutive", "full"])
def test_a_checkpointer_leaves_the_config_it_was_given_as_it_was_written(group, tmp_path, policy):
    """Every default the job decides is left open in the user's config, before and after a Checkpointer saved with
    it; the Checkpointer's own config has them settled, and its checkpoints record those."""
    root = str(tmp_path / "root")
    given = CheckpointConfig(root=root, policy=policy)
    written = copy.deepcopy(given)
    dmp, opt = build_dmp(_specs())
    with Checkpointer(dmp, given, dense_optimizer=opt) as ck:
        train(dmp, _specs(), opt, 2, torch.Generator().manual_seed(0))
        ck.save(1).wait()
        used = ck.config
    assert given == written and repr(given) == repr(written)
    q = given.quantization
    assert (q.bits, q.residual, given.failure.bits_table) == (None, "auto", None)
    assert given.compaction is DEFAULT_COMPACTION  # left at the default, not turned off under full
    assert used != given
    assert used.quantization.bits == 4 and used.quantization.residual is (policy == "consecutive")
    assert used.compaction == (DEFAULT_COMPACTION if policy == "consecutive" else None)
    assert used.failure.bits_table == (RESIDUAL_BITS_TABLE if policy == "consecutive" else DEFAULT_BITS_TABLE)
    storage = Storage(root)
    try:
        codec = load_manifest(storage, committed_ids(storage)[-1]).codec
    finally:
        storage.close()
    assert (codec["method"], codec["bits"], codec["bits_setting"]) == ("adaptive", 4, 4)  # as before resolve


# Each case's resolved values, as CheckpointConfig.__post_init__ and choose_residual settled them before resolve
# (compared field by field with the code before the change, on this toy model): bits, compaction, residual, table.
CASES = {
    "default": ({}, 4, DEFAULT_COMPACTION, True, RESIDUAL_BITS_TABLE),
    "full": ({"policy": "full"}, 4, None, False, DEFAULT_BITS_TABLE),
    "one_shot": ({"policy": "one_shot"}, 4, None, False, DEFAULT_BITS_TABLE),
    "intermittent": ({"policy": "intermittent"}, 4, None, False, DEFAULT_BITS_TABLE),
    "a row budget": ({"budget": {"max_rows_fraction": 0.5}}, 4, None, True, RESIDUAL_BITS_TABLE),
    "fp16": ({"quantization": {"method": "fp16"}}, None, DEFAULT_COMPACTION, False, DEFAULT_BITS_TABLE),
    "kmeans 3 bits, full": ({"policy": "full", "quantization": {"method": "kmeans", "bits": 3}}, 3, None, False,
                            DEFAULT_BITS_TABLE),
    "residual false": ({"quantization": {"residual": False}}, 4, DEFAULT_COMPACTION, False, DEFAULT_BITS_TABLE),
    "residual true": ({"quantization": {"residual": True}}, 4, DEFAULT_COMPACTION, True, RESIDUAL_BITS_TABLE),
    "a table given": ({"quantization": {"bits": "auto"}, "failure": {"expected_restores": 3, "bits_table": {20: 3}}},
                      "auto", DEFAULT_COMPACTION, True, {20: 3}),
    "a compaction given": ({"compaction": {"max_chain": 4}}, 4, CompactionConfig(max_chain=4), True,
                           RESIDUAL_BITS_TABLE),
    "no compaction": ({"compaction": None}, 4, None, True, RESIDUAL_BITS_TABLE),
}


@pytest.mark.parametrize("case", CASES)
def test_the_resolved_values_are_those_the_config_used_to_write_into_itself(group, case):
    over, bits, compaction, residual, table = CASES[case]
    given = load_config({"root": "/tmp/unused", **over})
    written = copy.deepcopy(given)
    used = _resolve(given)
    assert given == written
    assert (used.quantization.bits, used.compaction, used.quantization.residual, used.failure.bits_table) == (
        bits, compaction, residual, table)
    assert (used.compaction is DEFAULT_COMPACTION) == (compaction is DEFAULT_COMPACTION)
    assert _resolve(used) == used  # nothing is left to settle


def test_per_column_optimizer_state_resolves_to_plain_coding_with_its_table(group):
    used = _resolve(load_config({"root": "/tmp/unused"}), fused=EmbOptimType.EXACT_ADAGRAD)
    assert used.quantization.residual is False and used.failure.bits_table == DEFAULT_BITS_TABLE
