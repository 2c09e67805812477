"""bits: auto, interval: auto and their config errors (issue 5, items 1, 2 and 5)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from cnr_torchrec import ConfigError, load_config
from cnr_torchrec.ckpt.failure_rates import bits_for_job, interval_seconds, lost_fraction, plan_interval
from tests._dist import run_ranks


def cfg(**kw):
    return load_config({"root": "/tmp/unused", **kw})


@pytest.fixture(scope="module")
def job(group):
    """The config as a Checkpointer of a small job runs it (``config_resolve.resolve``): bits_for_job reads the
    measured table that resolve settles ``failure.bits_table: null`` to."""
    from _toy import build_dmp

    from cnr_torchrec.ckpt._collective import Ranks
    from cnr_torchrec.ckpt.config_resolve import resolve
    from examples.toy import TableSpec

    dmp, _ = build_dmp([TableSpec("t0", 64, 8, "row_wise")])
    return lambda config: resolve(config, dmp.dirty_tracker, Ranks())


@pytest.mark.parametrize("restores,bits", [(0, 4), (1, 4), (2, 8), (3, 8), (4, 8), (20, 8), (21, 8), (500, 8)])
def test_bits_follow_the_default_table(job, restores, bits):
    # The table measured by the accuracy studies for plain coding ({1: 4, 20: 8}; test_accuracy_bench checks where
    # it comes from). With residual: auto, the default, the job decides which table (test_residual_default).
    c = job(cfg(quantization={"bits": "auto", "residual": False}, failure={"expected_restores": restores}))
    assert bits_for_job(c, restores_done=0)[0] == bits


def test_residual_coding_gets_its_own_measured_table_unless_one_is_given(job, monkeypatch):
    from cnr_torchrec.ckpt import config

    quant = {"method": "adaptive", "bits": "auto", "residual": True}
    given = cfg(quantization=quant, failure={"expected_restores": 3})
    c = job(given)
    assert given.failure.bits_table is None  # the user's config keeps what they wrote
    assert c.failure.bits_table == config.RESIDUAL_BITS_TABLE == {3: 4, 20: 8}  # measured; see test_accuracy_bench
    assert bits_for_job(c, 0)[0] == 4
    plain = job(cfg(quantization={**quant, "residual": False}, failure={"expected_restores": 3}))
    assert bits_for_job(plain, 0)[0] == 8
    # Which measured table a config takes depends on the coding alone.
    monkeypatch.setattr(config, "RESIDUAL_BITS_TABLE", {20: 3})
    assert job(cfg(quantization=quant, failure={"expected_restores": 3})).failure.bits_table == {20: 3}
    assert job(cfg(quantization={**quant, "residual": False},
                   failure={"expected_restores": 3})).failure.bits_table == config.DEFAULT_BITS_TABLE
    monkeypatch.undo()
    given = job(cfg(quantization=quant, failure={"expected_restores": 3, "bits_table": {20: 3}}))
    assert bits_for_job(given, 0)[0] == 3
    with pytest.raises(ConfigError, match="fallback_bits must be at least"):
        cfg(quantization=quant, failure={"expected_restores": 3, "fallback_bits": 4})  # below the table's 8


def test_expected_restores_from_rate_and_hours_and_an_edited_table(job):
    c = cfg(quantization={"bits": "auto"}, failure={"failure_rate_per_hour": 0.05, "job_hours": 50,
                                                    "bits_table": {2: 3, 10: 4}, "fallback_bits": 8})
    assert c.failure.estimate_restores == math.ceil(0.05 * 50) == 3
    assert bits_for_job(c, 0) == (4, "3 restores expected (bits_table {2: 3, 10: 4})")
    c = job(cfg(quantization={"bits": "auto", "residual": False},
                failure={"failure_rate_per_hour": 0.5, "job_hours": 2}))
    assert c.failure.estimate_restores == 1  # exactly 1.0: not rounded up to 2
    assert bits_for_job(c, 0)[0] == 4  # the measured table: 4 bits for one restore


def test_fallback_once_restores_exceed_the_estimate():
    c = cfg(quantization={"bits": "auto"}, failure={"expected_restores": 3, "bits_table": {1: 2, 3: 3, 20: 4}})
    assert [bits_for_job(c, done)[0] for done in range(6)] == [3, 3, 3, 3, 8, 8]
    assert "4 restores so far exceed the 3 expected" in bits_for_job(c, 4)[1]
    fixed = cfg(quantization={"bits": 4})
    assert bits_for_job(fixed, 100) == (4, "configured")  # fixed bits never change


def test_young_daly_and_partial_recovery_intervals():
    full = cfg(interval="auto", failure={"mtbf_hours": 2.0})
    t, why = interval_seconds(full, save_cost_s=0.05, world_size=4)
    assert t == pytest.approx(math.sqrt(2 * 0.05 * 7200))
    assert "Young/Daly" in why
    partial = cfg(interval="auto", failure={"failure_rate_per_hour": 0.5, "recovery": "partial",
                                            "target_lost_fraction": 0.002})
    t, why = interval_seconds(partial, save_cost_s=123.0, world_size=4)  # the save cost does not matter
    assert t == pytest.approx(2 * 7200 * 4 * 0.002)
    assert lost_fraction(t, 7200, 4) == pytest.approx(0.002)  # exactly at the target
    assert lost_fraction(t * 1.1, 7200, 4) > 0.002
    plan = plan_interval(partial, step=100, step_s=0.5, save_cost_s=0.0, world_size=4)
    assert plan.interval_steps == round(t / 0.5) and plan.next_step == 100 + plan.interval_steps
    fixed = plan_interval(cfg(interval=7), step=14, step_s=0.5, save_cost_s=1.0, world_size=2)
    assert (fixed.interval_steps, fixed.next_step) == (7, 21)


@pytest.mark.parametrize("bad,match", [
    ({"quantization": {"bits": "auto"}}, "bits: auto needs a failure estimate"),
    ({"quantization": {"bits": "auto"}, "failure": {"failure_rate_per_hour": 0.1}}, "job_hours"),
    ({"quantization": {"method": "fp16", "bits": "auto"}, "failure": {"expected_restores": 2}}, "quantizing method"),
    ({"quantization": {"bits": "six"}}, "expected an integer or 'auto' or null"),
    ({"failure": {"failure_rate_per_hour": -0.1}}, "failure_rate_per_hour must be a positive number"),
    ({"failure": {"job_hours": 0}}, "job_hours must be a positive number"),
    ({"failure": {"expected_restores": -1}}, "expected_restores must be >= 0"),
    ({"failure": {"bits_table": {1: 4, 3: 2}}}, "must not lower the bits"),
    ({"failure": {"bits_table": {1: 5}}}, "bits must be 2, 3, 4 or 8"),
    ({"failure": {"bits_table": {1: 2}, "fallback_bits": 3, "expected_restores": 1}}, None),
    ({"failure": {"bits_table": {20: 8}, "fallback_bits": 4}}, "fallback_bits must be at least"),
    ({"failure": {"target_lost_fraction": 1.5}}, "target_lost_fraction must be in"),
    ({"failure": {"recovery": "some"}}, "recovery"),
    ({"interval": "auto"}, "interval: auto needs the failure rate"),
    ({"interval": 0}, "at least 1 step"),
    ({"interval": 2.5}, "expected an integer or 'auto' or null"),
    ({"budget": {"max_rows_fraction": 1.5}}, "max_rows_fraction must be in"),
    ({"budget": {"ssu_rate": 0}}, "ssu_rate must be in"),
    ({"budget": {"priority": "lru"}}, "priority"),
    ({"failure": {"mtbf_hour": 3}}, "did you mean 'mtbf_hours'"),
])
def test_inconsistent_settings_are_config_errors(bad, match):
    if match is None:
        cfg(**bad)  # a consistent setting loads
        return
    with pytest.raises(ConfigError, match=match):
        cfg(**bad)


# ---------------------------------------------------------------- with a Checkpointer (one rank)


def _build():
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from examples.toy import TableSpec, ToyModel, build_plan, sharders_for

    torch.manual_seed(0)
    specs = [TableSpec("t0", 300, 8, "row_wise"), TableSpec("t1", 200, 8, "table_wise")]
    model = ToyModel(specs)
    sharders = sharders_for(EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.05)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=build_plan(model, sharders, dist.get_world_size()), sharders=sharders)
    return dmp, specs


def _step(dmp, specs, gen):
    from examples.toy import zipf_batch

    dmp(zipf_batch(specs, batch_size=8, pooling=3, generator=gen)).backward()


def _bits_auto_worker(rank, world_size, root):
    from cnr_torchrec import Checkpointer

    config = load_config({"root": root, "quantization": {"bits": "auto"}, "failure": {"expected_restores": 1}})
    dmp, specs = _build()
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer(dmp, config)
    with pytest.raises(ConfigError, match="needs 'interval'"):
        ck.should_save(1)
    _step(dmp, specs, gen)
    ck.save(1).wait()
    for restore in (1, 2):  # the first restore is the one expected; the second exceeds the estimate
        ck.close()
        ck = Checkpointer(dmp, config)
        assert ck.restore() == restore
        assert ck.restores == restore
        _step(dmp, specs, gen)
        ck.save(restore + 1).wait()
    ck.close()
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import load_manifest

    storage = Storage(root)
    manifests = [load_manifest(storage, i) for i in range(3)]
    assert [m.restores for m in manifests] == [0, 1, 2]
    assert [m.codec["bits"] for m in manifests] == [4, 4, 8]  # 1 restore expected -> 4-bit, then fallback 8
    assert [m.codec["bits_setting"] for m in manifests] == ["auto"] * 3
    entry = manifests[2].ranks[0].tables["t0"][0]
    assert entry.weights.meta["bits"] == 8  # the rows themselves are 8-bit


@pytest.mark.timeout(120)
def test_bits_auto_switches_to_fallback_after_unexpected_restores(tmp_path):
    run_ranks(_bits_auto_worker, world_size=1, timeout=100, args=(str(tmp_path),))


def _interval_worker(rank, world_size, root, interval):
    from cnr_torchrec import Checkpointer

    failure = {"mtbf_hours": 0.0005, "recovery": "partial", "target_lost_fraction": 0.002}
    config = load_config({"root": root, "interval": interval, "failure": failure})
    dmp, specs = _build()
    ck = Checkpointer(dmp, config)
    gen = torch.Generator().manual_seed(rank)
    saved, plans = [], []
    for step in range(1, 41):
        _step(dmp, specs, gen)
        if ck.should_save(step):
            ck.save(step)
            saved.append(step)
            plans.append(ck._plan.interval_steps)
    ck.close()
    if interval == "auto":
        # T = 2 * 1.8 s * world_size * 0.002: a few steps of this tiny model; each save plans the next.
        assert saved[0] == 1 and len(saved) >= 3
        assert all(b - a == n for a, b, n in zip(saved, saved[1:], plans))
    else:
        assert saved == [1] + list(range(1 + interval, 41, interval))  # the first call takes the baseline


@pytest.mark.timeout(120)
@pytest.mark.parametrize("interval", [5, "auto"])
def test_should_save_follows_the_interval(tmp_path, interval):
    run_ranks(_interval_worker, world_size=2, timeout=100, args=(str(tmp_path), interval))
