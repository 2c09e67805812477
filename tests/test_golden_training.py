"""``examples/golden_training.py``: TorchRec's golden training program (DLRMTrain, row-wise Adagrad in the backward,
a KeyedOptimizerWrapper, TrainPipelineSparseDist, RandomRecDataset) checkpointed as the README says, under
torchrun on 2 gloo ranks with rank 1 killed once, right after a save.

One uninterrupted run (the shipped 4-bit config; saves do not change training, so it is the reference for both
codecs) against two runs that lose rank 1 before step 46 and resume from the save of step 40: with float32 rows
the resumed run ends bit for bit where the uninterrupted one does (tables, fused and dense optimizer state, eval
loss); with the default 4-bit rows its eval loss is within 1e-3.
"""

from __future__ import annotations

import json
import os

import pytest
from _torchrun import torchrun

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "golden_training.py")
STEPS, SAVE_EVERY, FAIL_AT = 80, 20, 46  # the kill comes 6 steps after the save of step 40
TIMEOUT_S = 240  # one torchrun: about 16 s, 30 s with the restart, on 2 idle cores

pytestmark = pytest.mark.multirank


def _golden(tmp_path, name: str, *args: str) -> tuple[dict, str]:
    """Runs the program under torchrun (2 ranks, one restart allowed) from ``tmp_path``; its JSON and its log."""
    out = tmp_path / f"{name}.json"
    rc, log = torchrun(GOLDEN, ["--root", str(tmp_path / name), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
                                "--out", str(out), *args],
                       cwd=tmp_path, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # pytorch#135712
                       timeout_s=TIMEOUT_S, name=name, restarts=1)
    assert rc == 0, f"{name}: torchrun exited {rc}:\n{log[-4000:]}"
    return json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    report, log = _golden(tmp_path_factory.mktemp("uninterrupted"), "uninterrupted")
    assert report["restored_step"] is None and "injected failure" not in log
    return report


def _resumed(tmp_path, *args: str) -> dict:
    """A run that loses rank 1 before step FAIL_AT; checks it restored the save before the kill and trained on."""
    report, log = _golden(tmp_path, "resumed", "--fail-at-step", str(FAIL_AT), "--fail-rank", "1", *args)
    assert f"[rank 1] injected failure before step {FAIL_AT}: SIGKILL" in log
    last_save = FAIL_AT // SAVE_EVERY * SAVE_EVERY
    assert f"restored step {last_save}, training from step {last_save + 1}" in log
    assert report["restored_step"] == last_save and report["steps"] == STEPS
    return report


@pytest.mark.timeout(600)
def test_a_float32_resume_ends_bit_for_bit_where_the_uninterrupted_run_does(uninterrupted, tmp_path):
    resumed = _resumed(tmp_path, "--fp32")
    for rank, (want, got) in enumerate(zip(uninterrupted["state"], resumed["state"])):
        assert got.keys() == want.keys()
        differ = sorted(k for k in want if got[k] != want[k])
        assert not differ, f"rank {rank}: {len(differ)} of {len(want)} tensors differ, e.g. {differ[:4]}"
    assert resumed["eval_loss"] == uninterrupted["eval_loss"]


@pytest.mark.timeout(360)
def test_a_4bit_resume_ends_within_1e3_of_the_uninterrupted_eval_loss(uninterrupted, tmp_path):
    resumed = _resumed(tmp_path)
    assert abs(resumed["eval_loss"] - uninterrupted["eval_loss"]) < 1e-3, (resumed["eval_loss"],
                                                                           uninterrupted["eval_loss"])
