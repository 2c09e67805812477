"""Which coding keeps quantized restores from compounding? A simulation on the accuracy study's tasks.

Run:  python benchmarks/restore_coding.py --task harsh --schemes rtn dpcm hot10 --bits 4 --restores 3 20

The training is the accuracy study's (``benchmarks/accuracy.py``: same DLRM, data, schedule and
reference run). At every save point this script computes, table by table, what a restore would
give back under a coding scheme, and at every restore point it writes those rows into the
model; optimizer state, dense parameters and the reader are left as they are, which is what the
real study's restores do with ``state_dtype: float32``. A row counts as written by a save when
its weights changed since the previous save. Schemes, all with the adaptive codec:

* ``rtn``: each written row is encoded as it is (what cnr_torchrec writes today). Its figures
  reproduce the real study's cells within their standard errors, which validates the simulation.
* ``dpcm``: each written row is encoded as its difference from the value the chain already
  restores for it (closed loop: the reconstruction is updated with the decoded difference), so
  a row's error is the quantization error of its last change, not of the whole row.
* ``hot<P>``: the P% of rows looked up most since the previous save are written at 8 bits,
  the others at ``--bits`` (Check-N-Run's MFU counters, used for width instead of order).

Before the schemes, it prints how far the codec is from idempotent on the reference run's
final rows: how many rows a second encode of a decoded row changes, and by how much. A restored
row that training leaves alone is never re-encoded by a delta, and a whole-shard write re-encodes
it from its decoded value; with an idempotent codec neither adds error.

This is the design study; ``dpcm`` is now the Checkpointer's ``quantization.residual``, whose real
figures (``benchmarks/accuracy.py --residual``) match this simulation's (docs/accuracy.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accuracy as A  # noqa: E402

from cnr_torchrec.quant import get_codec  # noqa: E402


def _roundtrip(rows: torch.Tensor, bits: int) -> torch.Tensor:
    if rows.shape[0] == 0:
        return rows
    codec = get_codec("adaptive", bits)
    return codec.decode(codec.encode(rows.contiguous()))


class Chain:
    """What the checkpoints written so far restore, table by table, under one scheme."""

    def __init__(self, views: dict[str, torch.Tensor], scheme: str, bits: int) -> None:
        self.views, self.scheme, self.bits = views, scheme, bits
        self.last = {t: v.detach().clone() for t, v in views.items()}
        self.recon = {t: torch.zeros_like(v) for t, v in views.items()}
        self.counts = {t: torch.zeros(v.shape[0], dtype=torch.long) for t, v in views.items()}
        self.width = {t: torch.zeros(v.shape[0]) for t, v in views.items()}

    def looked_up(self, kjt: Any) -> None:
        for key in kjt.keys():
            c = self.counts[f"t_{key}"]
            c += torch.bincount(kjt[key].values(), minlength=c.numel())

    def save(self) -> None:
        for t, v in self.views.items():
            x = v.detach()
            rows = ((x != self.last[t]).any(dim=1) | (self.width[t] == 0)).nonzero().flatten()
            if self.scheme == "dpcm":
                self.recon[t][rows] += _roundtrip(x[rows] - self.recon[t][rows], self.bits)
                self.width[t][rows] = self.bits
            else:
                for part, bits in self._widths(t, rows):
                    self.recon[t][part] = _roundtrip(x[part], bits)
                    self.width[t][part] = bits
            self.last[t] = x.clone()
            self.counts[t].zero_()

    def _widths(self, t: str, rows: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        if not self.scheme.startswith("hot"):
            return [(rows, self.bits)]
        k = min(rows.numel(), int(float(self.scheme[3:]) / 100 * self.views[t].shape[0]))
        counts = self.counts[t][rows]
        hot = torch.zeros(rows.numel(), dtype=torch.bool)
        if k:
            hot[torch.topk(counts.double() - rows.double() * 1e-12, k).indices] = True  # ties: lower row first
        hot &= counts > 0
        return [(rows[hot], 8), (rows[~hot], self.bits)]

    @torch.no_grad()
    def restore(self) -> None:
        for t, v in self.views.items():
            v.copy_(self.recon[t])
            self.last[t] = v.detach().clone()

    def bits_per_row(self) -> float:
        stored = torch.cat([w[w > 0] for w in self.width.values()])
        return float(stored.mean()) if stored.numel() else float("nan")


def simulate(args: argparse.Namespace, task: A.Task, scheme: str | None, restores: int) -> dict[str, Any]:
    """One run: the reference when ``scheme`` is None."""
    dmp, opt = A.build(args, task.stream, 0)
    tracker = dmp.dirty_tracker
    views = {t: k.tbe.split_embedding_weights()[s.local_index] for t in tracker.tables()
             for k, s in tracker.shards(t)}
    chain = Chain(views, scheme or "rtn", args.bits)
    points = set(A.restore_steps(args.steps, restores)) if scheme else set()
    for step, batch in enumerate(task.train[: args.steps], start=1):
        A.set_lr(args, step, opt, tracker.tbes())
        chain.looked_up(batch.sparse_features)
        loss, _ = dmp(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheme and ((args.interval and step % args.interval == 0) or step in points):
            chain.save()
        if step in points:
            chain.restore()
    logits = A.eval_logits(dmp, task)
    return {"logits": logits, "logloss": float(A._losses(logits, A._gather(torch.cat([e.labels for e in task.eval])))
                                                 .mean()),
            "ckpt_bytes": 0, "save_restore_ms": 0.0, "wall_s": 0.0, "bits_per_row": chain.bits_per_row(),
            "tables": {t: v.detach().clone() for t, v in views.items()}}


def idempotence(tables: dict[str, torch.Tensor], bits: int) -> str:
    """How much a second round trip through adaptive ``bits`` moves rows that went through one already."""
    rows = torch.cat(list(tables.values()))
    once = _roundtrip(rows, bits)
    twice = _roundtrip(once, bits)
    moved = (twice != once).any(dim=1).float().mean()
    drift = (twice - once).abs().mean() / (once - rows).abs().mean()
    return f"{bits}-bit: {moved * 100:.2f}% of rows move, by {drift:.1e} of the first round trip's error"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(A.TASKS), default="harsh")
    ap.add_argument("--schemes", nargs="*", default=["rtn", "dpcm", "hot10"],
                    help="none: only the reference run and the idempotence check")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--restores", nargs="+", type=int, default=[3, 20])
    cli = ap.parse_args()
    preset = A.TASKS[cli.task]
    args = argparse.Namespace(**preset, bits=cli.bits, min_rows=64, dim=16, lr=0.05, schedule="linear", signal=2.0,
                              zipf=1.05, row_wise_min_rows=5000)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='cnr-coding-')}", rank=0,
                            world_size=1)
    task = A.make_task(args)
    labels = A._gather(torch.cat([e.labels for e in task.eval]))
    ref = simulate(args, task, None, 0)
    print(f"task {cli.task}: reference logloss {ref['logloss']:.5f}")
    print("encode(decode(encode(row))) against encode(row), adaptive, the reference's "
          f"{sum(v.shape[0] for v in ref['tables'].values())} final rows:")
    for bits in (2, 3, 4, 8):
        print("  " + idempotence(ref["tables"], bits), flush=True)
    if cli.schemes:
        print(f"adaptive {cli.bits}-bit; dlogloss_rel (paired se)")
    for scheme in cli.schemes:
        for r in cli.restores:
            run = simulate(args, task, scheme, r)
            c = A.compare(run, ref, labels)
            print(f"{scheme:>6} R={r:<3} {c['dlogloss_rel'] * 100:+.4f}% ({c['se_rel'] * 100:.4f}%), "
                  f"{run['bits_per_row']:.2f} bits per stored row", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
