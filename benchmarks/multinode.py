"""A job that spans nodes: torchrun agents on loopback, c10d rendezvous, an s3:// root on moto.

The scenario (``python benchmarks/multinode.py``, part of ``make reliability``; a test runs the
same code, ``tests/test_multinode.py``):

1. **Kill mid-save.** Two torchrun agents (``--nnodes 2``, 2 workers each, 4 ranks) train the
   job with its checkpoints on ``s3://``. On node A, local rank 1 is SIGKILLed half way through
   writing its file of the second save (``CNR_FAULT=write.mid:local_rank=1:nth=2``). Node A's
   agent restarts its workers under ``--max-restarts 1``, node B's agent restarts its own for
   the new rendezvous round, the job restores and finishes.
2. **The peer.** The same two nodes train the same job with no kill, stopping at the step the
   killed job restored and starting again from its checkpoint there. fp32 checkpoints restore
   exactly and every rank reads its batches from the restored step, so the killed job must end
   with the peer's weights, optimizer state and eval, bit for bit. (A peer that never stops
   differs in the last bit: DDP's first iteration after a start buckets gradients in another
   order, and a sum over 4 ranks depends on the order.)
3. **4 -> 2.** One node of 2 ranks (another plan) restores the 4-rank checkpoint of step
   ``steps`` without training: its tables, gathered from every rank's shards, must equal the
   4-rank job's. It then trains ``extra`` more steps and checkpoints them.
4. **2 -> 4.** The two nodes again restore the 2-rank checkpoint and must hold the same
   model as the 2-rank job that wrote it.

Every phase runs the real job (``python -m cnr_dlrm.train``) under the real launcher;
the comparisons are against the weights the other world size dumped, never against our reader.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reliability import Moto  # noqa: E402

# The tiny job of the torchrun tests (tests/test_train.py uses it too): two tables shared by several features.
TINY = {
    "data": {"scale": 0.0005, "min_rows": 16, "batch_size": 64},
    "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1],
              "row_wise_min_rows": 1000, "shared_tables": [["cat_0", "cat_1"], ["cat_2", "cat_3", "cat_4"]]},
    "train": {"steps": 12, "checkpoint_interval": 4, "eval_batches": 2},
    "checkpoint": {"policy": "consecutive", "quantization": {"method": "none"}},
}
# The second save's payload write on the first node's local rank 1 (each save writes the rank's one chunk, then
# its part: format 7), torn half way.
KILL = "write.mid:local_rank=1:nth=3"


@dataclass
class Run:
    """One launch of the job: its report, every agent's output and the state each rank dumped."""

    report: dict[str, Any]
    logs: list[str]
    dump: str
    seconds: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Launches the job on ``nodes`` torchrun agents of ``nproc`` workers each, on one s3 root."""

    def __init__(self, work: str, moto: Moto, root: str, timeout: float = 300) -> None:
        self.work, self.moto, self.root, self.timeout = work, moto, root, timeout
        self._runs = 0

    def run(self, name: str, nodes: int, nproc: int, steps: int, fault_on_first_node: str = "",
            extra_args: tuple[str, ...] = ()) -> Run:
        cfg = json.loads(json.dumps(TINY))
        cfg["train"]["steps"] = steps
        cfg["checkpoint"]["root"] = self.root
        path = os.path.join(self.work, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        dump, report = os.path.join(self.work, f"dump-{name}"), os.path.join(self.work, f"report-{name}.json")
        job = ["-m", "cnr_dlrm.train", "--config", path, "--dump-state", dump, "--report", report, *extra_args]
        if nodes == 1:
            launch = ["--standalone"]
        else:
            self._runs += 1
            launch = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"127.0.0.1:{_free_port()}", "--rdzv-id", f"{name}-{self._runs}", "--monitor-interval", "0.5"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", str(nproc),
               "--max-restarts", "1", *job]
        env = {**os.environ, **self.moto.env(), "OMP_NUM_THREADS": "1"}
        env.pop("CNR_FAULT", None)
        t0 = time.perf_counter()
        procs = []
        for node in range(nodes):
            logs = open(os.path.join(self.work, f"{name}-node{node}.log"), "w+")
            node_env = {**env, "CNR_FAULT": fault_on_first_node} if node == 0 and fault_on_first_node else env
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=node_env, stdout=logs, stderr=subprocess.STDOUT), logs))
        texts, failed = [], []
        deadline = time.monotonic() + self.timeout
        for node, (proc, logs) in enumerate(procs):
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p, _ in procs:
                    p.kill()
                rc = "timeout"
            logs.seek(0)
            texts.append(logs.read())
            logs.close()
            if rc != 0:
                failed.append(f"node {node}: exit {rc}\n{texts[-1][-4000:]}")
        if failed:
            raise AssertionError(f"{name}: " + "\n".join(failed))
        with open(report) as f:
            return Run(json.load(f), texts, dump, time.perf_counter() - t0)


# ---------------------------------------------------------------------- the model a run dumped

def gather_model(dump: str) -> dict[str, torch.Tensor]:
    """Whole tables (weights, optimizer state) from every rank's shards; dense state from rank 0.

    A dump key is ``emb/<table>/rows<a>-<b>/cols<c>-<d>`` (or ``emb_state<j>/...``); shards of
    a replicated table appear on every rank and agree.
    """
    files = sorted(f for f in os.listdir(dump) if f.startswith("rank-"))
    pieces: dict[str, list[tuple[tuple[int, int], tuple[int, int], torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(files):
        for key, t in torch.load(os.path.join(dump, name), weights_only=True).items():
            kind, *rest = key.split("/")
            if kind.startswith("emb"):
                table, rows, cols = rest
                a, b = map(int, rows[len("rows"):].split("-"))
                c, d = map(int, cols[len("cols"):].split("-"))
                pieces.setdefault(f"{kind}/{table}", []).append(((a, b), (c, d), t))
            elif i == 0:
                out[key] = t
    for key, shards in pieces.items():
        rows = max(r[1] for r, _, _ in shards)
        cols = max(c[1] for _, c, _ in shards)
        if shards[0][2].dim() == 1:  # row-wise optimizer state: one value per row
            full = torch.full((rows,), float("nan"))
            for (a, b), _, t in shards:
                full[a:b] = t
        else:
            full = torch.full((rows, cols), float("nan"))
            for (a, b), (c, d), t in shards:
                full[a:b, c:d] = t
        out[key] = full
    return out


def model_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (NaN counts as a hole no shard covered)."""
    if a.keys() != b.keys():
        return [f"keys: {sorted(a.keys() ^ b.keys())[:6]}"]
    return [k for k in sorted(a) if torch.isnan(a[k]).any() or not torch.equal(a[k], b[k])]


# ---------------------------------------------------------------------- the scenario

def scenario(work: str, moto: Moto, steps: int = 12, extra: int = 4, peer: bool = True) -> dict[str, Any]:
    """Runs the four phases (the peer only if ``peer``) and returns their figures; raises on a failed check."""
    root = f"s3://{moto.bucket}/multinode/{os.path.basename(work)}"
    cluster = Cluster(work, moto, root)
    figures: dict[str, Any] = {}

    killed = cluster.run("killed", nodes=2, nproc=2, steps=steps, fault_on_first_node=KILL)
    r = killed.report
    log = "\n".join(killed.logs)
    assert f"fault {KILL}" in log, "the fault never fired"
    assert r["world_size"] == 4 and r["restores"] == 1, r["restores"]
    assert r["start_step"] == r["restored_from"][0]["step"] and r["start_step"] < steps
    assert [c["step"] for c in r["checkpoints"]] == list(range(TINY["train"]["checkpoint_interval"], steps + 1,
                                                               TINY["train"]["checkpoint_interval"]))
    figures["killed"] = {"restored_step": r["start_step"], "seconds": round(killed.seconds, 1)}
    model_4 = gather_model(killed.dump)

    if peer:
        peers = Cluster(work, moto, f"{root}-peer")
        peers.run("peer-first", nodes=2, nproc=2, steps=r["start_step"])
        straight = peers.run("peer", nodes=2, nproc=2, steps=steps)
        assert straight.report["restores"] == 1 and straight.report["start_step"] == r["start_step"]
        diff = model_diff(model_4, gather_model(straight.dump))
        assert not diff, f"the killed job does not end where the uninterrupted one does: {diff[:5]}"
        assert killed.report["eval"] == straight.report["eval"]
        figures["peer"] = {"seconds": round(straight.seconds, 1)}

    onto_2 = cluster.run("onto-2", nodes=1, nproc=2, steps=steps)
    assert onto_2.report["world_size"] == 2 and onto_2.report["start_step"] == steps
    diff = model_diff(model_4, gather_model(onto_2.dump))
    assert not diff, f"4 -> 2 ranks restored another model: {diff[:5]}"

    trained_2 = cluster.run("train-2", nodes=1, nproc=2, steps=steps + extra)
    # The journal under the root counts every restore of the job (the kill, then one per resume).
    assert trained_2.report["start_step"] == steps and trained_2.report["restored_from"][-1]["step"] == steps
    assert trained_2.report["checkpoints"][-1]["step"] == steps + extra

    onto_4 = cluster.run("onto-4", nodes=2, nproc=2, steps=steps + extra)
    assert onto_4.report["world_size"] == 4 and onto_4.report["start_step"] == steps + extra
    diff = model_diff(gather_model(trained_2.dump), gather_model(onto_4.dump))
    assert not diff, f"2 -> 4 ranks restored another model: {diff[:5]}"
    figures["reshard"] = {"4_to_2_s": round(onto_2.seconds, 1), "train_2_s": round(trained_2.seconds, 1),
                          "2_to_4_s": round(onto_4.seconds, 1)}
    figures["objects"] = len(moto.keys(root.split("/", 3)[3]))
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="steps of the 4-rank job (checkpoint every 4)")
    ap.add_argument("--extra", type=int, default=8, help="steps the 2-rank job trains after resharding")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    moto = Moto()
    try:
        with tempfile.TemporaryDirectory(prefix="cnr-multinode-") as work:
            figures = scenario(work, moto, args.steps, args.extra)
    finally:
        moto.close()
    print(json.dumps(figures, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
