"""examples/serve.py beside a running trainer: TorchRec's golden training program on 2 torchrun ranks, saving
float32 rows every 20 steps, and the serving example following its root in a process of its own.

References: the trainer's own final eval loss (which the float copy the example follows must give at the last
step), and the order of the trainer's commits (every one after the first load served, once, in order). The served int8 model's
AUC stays within 0.01 of the float model's at every step, and every update is served within the poll interval
and 1 s of its commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _torchrun import torchrun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_EVERY, POLL_S = 80, 20, 0.2


@pytest.mark.timeout(300)
def test_the_serving_example_serves_every_commit_of_a_running_trainer_in_order(tmp_path):
    root, served = str(tmp_path / "root"), str(tmp_path / "served.jsonl")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    serve = subprocess.Popen([sys.executable, os.path.join(REPO, "examples", "serve.py"), "--root", root,
                              "--until-step", str(STEPS), "--poll-s", str(POLL_S), "--json", served,
                              "--timeout-s", "240"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        for line in serve.stdout:  # built and following: the trainer's first commit cannot be missed
            if line.startswith("serve:"):
                break
        rc, log = torchrun(os.path.join(REPO, "examples", "golden_training.py"),
                           ["--root", root, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--fp32",
                            "--out", str(tmp_path / "trainer.json")], cwd=tmp_path,
                           env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, timeout_s=240, name="trainer")
        assert rc == 0, log[-3000:]
        rest, _ = serve.communicate(timeout=120)
    finally:
        serve.kill()
    (tmp_path / "serve.log").write_text(rest)
    assert serve.returncode == 0, rest[-3000:]
    updates = [json.loads(line) for line in open(served)]
    # The first poll loads the newest commit (on 2 busy cores it may come after the second); from then on every
    # commit is served, once, in order.
    first = updates[0]["step"]
    assert [u["step"] for u in updates] == list(range(first, STEPS + 1, SAVE_EVERY)) and first < STEPS, updates
    assert [u["how"] for u in updates] == ["reload"] + ["delta"] * (len(updates) - 1), updates
    assert all(u["lag_s"] <= POLL_S + 1.0 for u in updates), [u["lag_s"] for u in updates]
    evaluated = [u for u in updates if "auc" in u]
    assert evaluated[-1]["step"] == STEPS
    assert all(abs(u["auc"] - u["trainer_auc"]) <= 0.01 for u in evaluated)
    trainer = json.load(open(tmp_path / "trainer.json"))
    assert evaluated[-1]["trainer_loss"] == pytest.approx(trainer["eval_loss"], rel=1e-5)
