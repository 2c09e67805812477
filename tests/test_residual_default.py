"""``quantization.residual: auto``, the default: residual coding wherever the job can have it, plain coding
with a warning where it cannot, and ``true`` refusing the same cases by name."""

from __future__ import annotations

import pytest
import torch
from _toy import build_dmp, train
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from cnr_torchrec.errors import ConfigError


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _residual_flags(root):
    """Per checkpoint under ``root``, oldest first: whether it stores residual rows."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.summary import summarize

    storage = Storage(root)
    try:
        return [r["residual"] for r in summarize(storage)["checkpoints"]]
    finally:
        storage.close()


def _two_saves(dmp, opt, config):
    """Two saves of a trained model (a baseline and a delta); returns the Checkpointer's config."""
    from cnr_torchrec import Checkpointer

    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in (1, 2):
            train(dmp, _specs(), opt, 2, gen)
            ck.save(step).wait()
        return ck.config


def test_the_default_config_codes_residuals_with_their_measured_table(group, tmp_path):
    from cnr_torchrec import load_config
    from cnr_torchrec.ckpt.config import RESIDUAL_BITS_TABLE, CheckpointConfig

    root = str(tmp_path / "root")
    given = CheckpointConfig(root=root)
    assert given.quantization.residual == "auto" and given.quantization.bits is None
    dmp, opt = build_dmp(_specs())
    used = _two_saves(dmp, opt, given)
    assert used.quantization.residual is True and used.quantization.bits == 4
    assert given.quantization.residual == "auto"  # the Checkpointer's config is its own
    assert used.failure.bits_table == RESIDUAL_BITS_TABLE
    assert _residual_flags(root) == [False, True]
    # The shipped job's config says the same.
    assert load_config("configs/consecutive.yaml", root=root).quantization.residual == "auto"


@pytest.mark.parametrize("cfg", [{"policy": "one_shot"}, {"quantization": {"method": "fp16"}},
                                 {"policy": "full", "quantization": {"method": "kmeans", "bits": 3}}])
def test_auto_is_plain_coding_where_the_config_has_no_use_for_residuals(group, cfg):
    from cnr_torchrec import load_config
    from cnr_torchrec.ckpt._collective import Ranks
    from cnr_torchrec.ckpt.config import DEFAULT_BITS_TABLE
    from cnr_torchrec.ckpt.config_resolve import resolve

    config = load_config({"root": "/tmp/unused", **cfg})
    assert config.quantization.residual == "auto" and config.residual_from_config is False
    dmp, _ = build_dmp(_specs())
    used = resolve(config, dmp.dirty_tracker, Ranks())
    assert used.quantization.residual is False
    assert used.failure.bits_table == DEFAULT_BITS_TABLE


def test_per_column_optimizer_state_is_coded_plainly_under_auto_and_refused_under_true(group, tmp_path, caplog):
    """EXACT_ADAGRAD keeps a sum of squares per weight: auto warns and codes plainly, true names the tables."""
    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.config import DEFAULT_BITS_TABLE

    dmp, opt = build_dmp(_specs(), fused=EmbOptimType.EXACT_ADAGRAD)
    refused = str(tmp_path / "refused")
    with pytest.raises(ConfigError, match=r"table\(s\) t0, t1 keep optimizer state per column .* residual: false"):
        Checkpointer(dmp, load_config({"root": refused, "quantization": {"residual": True}}), dense_optimizer=opt)
    assert not (tmp_path / "refused").exists()  # refused before anything was opened

    root = str(tmp_path / "root")
    with caplog.at_level("WARNING", logger="cnr_torchrec.ckpt.residual_choice"):
        used = _two_saves(dmp, opt, load_config({"root": root}))
    assert "residual: auto steps aside" in caplog.text and "t0, t1 keep optimizer state per column" in caplog.text
    assert used.quantization.residual is False and used.failure.bits_table == DEFAULT_BITS_TABLE
    assert _residual_flags(root) == [False, False]


def test_a_host_short_of_memory_is_coded_plainly_under_auto_and_refused_under_true(
        group, tmp_path, caplog, monkeypatch):
    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt import host_memory

    dmp, opt = build_dmp(_specs())
    short = host_memory.reconstruction_bytes(dmp.dirty_tracker) - 1
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: short)
    with pytest.raises(ConfigError, match="quantization.residual keeps a float32 copy"):
        Checkpointer(dmp, load_config({"root": str(tmp_path / "refused"), "quantization": {"residual": True}}),
                     dense_optimizer=opt)
    root = str(tmp_path / "root")
    with caplog.at_level("WARNING", logger="cnr_torchrec.ckpt.residual_choice"):
        used = _two_saves(dmp, opt, load_config({"root": root}))
    assert "residual: auto steps aside" in caplog.text and "which has" in caplog.text
    assert used.quantization.residual is False
    assert _residual_flags(root) == [False, False]


def _entry_flags(root, ckpt_id):
    """table -> whether each of checkpoint ``ckpt_id``'s entries of that table is stored as residuals."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import load_manifest

    storage = Storage(root)
    try:
        flags: dict[str, list[bool]] = {}
        for report in load_manifest(storage, ckpt_id).ranks:
            for table, e in report.entries():
                flags.setdefault(table, []).append(e.residual)
        return flags
    finally:
        storage.close()


def test_a_delta_whose_first_shard_has_no_dirty_rows_codes_the_later_shards_as_residuals(group, tmp_path):
    """The delta's first shard (t0's) comes out plain, having no rows to code; t1's rows are still residuals."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from cnr_torchrec import Checkpointer, load_config

    specs = _specs()
    dmp, opt = build_dmp(specs)
    root = str(tmp_path / "root")
    with Checkpointer(dmp, load_config({"root": root}), dense_optimizer=opt) as ck:
        train(dmp, specs, opt, 2, torch.Generator().manual_seed(0))
        ck.save(1).wait()
        t1_ids = torch.tensor([1, 5, 9, 30] * 2)
        only_t1 = KeyedJaggedTensor.from_lengths_sync(
            keys=[s.feature for s in specs], values=t1_ids,
            lengths=torch.cat([torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64)]))
        dmp(only_t1).backward()
        opt.step()
        ck.save(2).wait()
        assert ck.config.quantization.residual is True
    flags = _entry_flags(root, 1)
    assert flags["t0"] == [False] and flags["t1"] == [True], flags
