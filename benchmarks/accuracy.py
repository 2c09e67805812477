"""Accuracy study: how much final eval logloss do quantized restores cost? (Check-N-Run's bits-vs-restores rule)

Run:  python benchmarks/accuracy.py [--json PATH] [--markdown PATH]     (one process, world size 1)
      torchrun --standalone --nproc_per_node 2 benchmarks/accuracy.py   (2 ranks; about twice the time here)

Every run trains the same DLRM (cnr_dlrm.dlrm) on the same synthetic Criteo stream
(cnr_dlrm.data) from the same seed, for the same steps, sharded by the real ``CheckNRunDMP``.
A cell (method, bits, R) restores R times, at steps ``k * T / (R + 1)`` for k = 1..R: at each,
``Checkpointer.save(s).wait()`` and then ``Checkpointer.restore()``: a failure right after a
checkpoint, so no step is lost or replayed and the only effect is the codec's, on the embedding
rows that the restore brings back. The policy is ``consecutive`` (a delta holds the rows changed
since the previous save; ``--policy full`` makes every save a baseline): either way a restore gives
back every row as the codec returns it, the rows touched since the previous restore freshly
encoded and the others as they were restored last time (re-encoding a decoded row is exact for
uniform_asym and changes a few rows slightly for adaptive and kmeans at 2-3 bits; see docs/accuracy.md).
Optimizer row state is float32 (``state_dtype: float32``), dense parameters and their
optimizer are exact, and the reader position is restored (with the restore right after the save
nothing is replayed), so each run sees the same batches in the same order. The reference trains
with no failure at all.

Both optimizers' learning rates decay linearly to 0 over the run (``--schedule``): at a constant
rate the eval logloss wanders by about 1% from one step to the next, and a perturbation of any
size moved the final logloss by about 0.2%, which drowned every codec. Batches are made once
and reused by every run (the StatefulDataLoader still tracks, saves and restores the position).

Each cell gives ``dlogloss_rel = (logloss_cell - logloss_ref) / logloss_ref`` on the same held-out
samples, with its paired standard error (per-sample loss differences). Controls frame it:
``none`` x max(R) (fp32 rows: must be bit-identical to the reference, which checks that save and
restore alone change nothing); ``fp16`` and ``bf16`` x each R (smaller perturbations than any codec
of the grid, relative MSE 4e-8 and 3e-6 against 1.3e-5 for 8-bit on 16-wide rows: what they move
the logloss by is that column's trajectory floor, the effect of any perturbation at those steps);
and the reference with another init seed (the run-to-run spread of a training job). A cell within
2 paired SE or its column's floor is "no measurable degradation" (``~``).

It prints the learning curve of the reference run, the grid (rows method x bits, columns R,
cells signed percentages), the noise figures, the paper's rule against the grid and the widths
this task needs instead, and writes ``--markdown PATH`` (the table) and ``--json PATH``
(``"{method}_{bits}_{restores}": {"dlogloss_rel": ..., "se_rel": ..., ...}``, and ``"_study"``:
the reference, learning curve, controls, floors and config). Defaults: 1000 steps x 1024 samples,
scale 0.001 (34,872 rows x 16), 262,144 eval samples: about 14 minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cnr_torchrec import CheckNRunDMP, Checkpointer, load_config
from cnr_torchrec.errors import ConfigError

# The repository root, for the example job and models (cnr_dlrm, examples), which are not in the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cnr_dlrm.data import DataConfig, ResumableReader, SyntheticCriteo, make_loader  # noqa: E402
from cnr_dlrm.dlrm import ModelConfig, build_model, build_plan, dense_parameters, make_sharder  # noqa: E402

METHODS = ("uniform_asym", "adaptive", "kmeans")
BITS = (2, 3, 4, 8)
RESTORES = (1, 3, 10, 20)
# Check-N-Run's rule: most restores each width survives within 0.01% relative logloss. bits: auto's default
# (cnr_torchrec.ckpt.config.DEFAULT_BITS_TABLE) comes from these studies instead: recommend_bits_table().
PAPER_RULE = {2: 1, 3: 3, 4: 20}
PAPER_TOLERANCE = 1e-4
EVAL_CHUNK = 4096
# The two tasks (docs/accuracy.md says how each was sized).
# harsh: 34,872 rows, nearly every row dirty between two restores, saves only at the restore points.
# production: 1,013,557 rows, Zipf 1.05, a checkpoint every 50 steps (at most ~8% of rows dirty per interval).
TASKS: dict[str, dict[str, Any]] = {
    "harsh": {"steps": 1000, "scale": 0.001, "batch_size": 1024, "eval_samples": 262144, "interval": 0},
    "production": {"steps": 1000, "scale": 0.03, "batch_size": 1024, "eval_samples": 262144, "interval": 50},
}


@dataclass
class Task:
    """One rank's data, generated once and reused by every run (every run reads the same batches)."""

    stream: SyntheticCriteo
    train: list[Any]
    eval: list[Any]
    eval_detail: dict[str, float] = field(default_factory=dict)


class _Batches(torch.utils.data.Dataset):
    """A map-style dataset over batches made in advance: the StatefulDataLoader still tracks the position."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.batches[i]


def make_task(args: argparse.Namespace) -> Task:
    """This rank's training batches and held-out samples, made once: generating them costs more than a step."""
    rank = dist.get_rank()
    cfg = DataConfig(scale=args.scale, min_rows=args.min_rows, batch_size=args.batch_size, signal=args.signal,
                     zipf=args.zipf, seed=args.seed)  # the task (teacher, id law) is the same for every seed
    stream = SyntheticCriteo(cfg)
    b = args.batch_size
    train = [stream.batch(rank, i * b, (i + 1) * b, "train") for i in range(args.steps)]
    per_rank = math.ceil(args.eval_samples / dist.get_world_size())
    eval_batches, teacher = [], []
    for start in range(0, per_rank, EVAL_CHUNK):
        batch, logits = stream.generate(rank, start, min(per_rank, start + EVAL_CHUNK), "eval")
        eval_batches.append(batch)
        teacher.append(logits.float())
    labels = _gather(torch.cat([e.labels for e in eval_batches]))
    t_logits = _gather(torch.cat(teacher))
    rate = float(labels.mean())
    detail = {
        "samples": int(labels.numel()),
        "label_rate": rate,
        "label_entropy": -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)),
        "teacher_logloss": float(_losses(t_logits, labels).mean()),
    }
    return Task(stream, train, eval_batches, detail)


def _gather(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample binary cross-entropy in nats (float64): the eval logloss is their mean."""
    return torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double(), reduction="none")


def build(args: argparse.Namespace, stream: SyntheticCriteo, init_seed: int) -> tuple[CheckNRunDMP, Any]:
    """A fresh sharded DLRM and its dense Adagrad, identical in every run of the same ``init_seed``."""
    from torchrec.distributed.types import ShardingEnv

    mcfg = ModelConfig(embedding_dim=args.dim, dense_arch_layer_sizes=(32, args.dim), over_arch_layer_sizes=(64, 1),
                       row_wise_min_rows=args.row_wise_min_rows, init_seed=init_seed)
    torch.manual_seed(init_seed)  # the table rows are drawn when the DMP allocates its shards
    model = build_model(mcfg, stream.table_rows, stream.keys, torch.device("cpu"))
    sharder = make_sharder("rowwise_adagrad", args.lr)
    plan = build_plan(model, sharder, dist.get_world_size(), mcfg.row_wise_min_rows)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=plan, sharders=[sharder])
    dense = dense_parameters(dmp, dmp.dirty_tracker.module_fqns())
    return dmp, torch.optim.Adagrad([p for _, p in dense], lr=args.lr)


@torch.no_grad()
def eval_logits(dmp: CheckNRunDMP, task: Task) -> torch.Tensor:
    """Logits of every rank's held-out samples, gathered (eval lookups mark no row dirty)."""
    dmp.eval()
    out = [dmp(b)[1][1].float() for b in task.eval]
    dmp.train()
    return _gather(torch.cat(out))


def restore_steps(steps: int, restores: int) -> list[int]:
    """R restore points spread evenly over the run: k * T / (R + 1), k = 1..R."""
    points = sorted({round(k * steps / (restores + 1)) for k in range(1, restores + 1)})
    if len(points) != restores or points[0] < 1:
        raise ConfigError(f"{restores} restores do not fit in {steps} steps at distinct steps; raise --steps")
    return points


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Learning rate of ``step`` (1-based): constant, or a linear decay to 0 over the run."""
    if args.schedule == "constant":
        return args.lr
    return args.lr * (1.0 - (step - 1) / args.steps)


def set_lr(args: argparse.Namespace, step: int, opt: torch.optim.Optimizer, tbes: list[Any]) -> None:
    """Sets the dense optimizer's and every fused table optimizer's learning rate for ``step``."""
    lr = lr_at(args, step)
    for group in opt.param_groups:
        group["lr"] = lr
    for tbe in tbes:
        tbe.set_learning_rate(lr)


def train_run(args: argparse.Namespace, task: Task, *, method: str | None = None, bits: int | None = None,
              restores: int = 0, init_seed: int | None = None, curve_at: tuple[int, ...] = ()) -> dict[str, Any]:
    """One training run; ``method`` None is a run with no failure. Returns the gathered eval logits and figures.
    ``init_seed``: the model's (default ``--seed``)."""
    t0 = time.perf_counter()
    dmp, opt = build(args, task.stream, args.seed if init_seed is None else init_seed)
    reader = ResumableReader(make_loader(_Batches(task.train)))
    ck, root, compaction = None, None, None
    points = restore_steps(args.steps, restores) if method is not None else []
    if method is not None:
        root = tempfile.mkdtemp(prefix="cnr-accuracy-", dir=args.out_dir) if dist.get_rank() == 0 else ""
        holder = [root]
        dist.broadcast_object_list(holder)
        root = holder[0]
        grid = method not in ("none", "fp16", "bf16")
        quant = {"method": method, "bits": bits, "state_dtype": "float32",
                 "residual": bool(getattr(args, "residual", False) and grid)}
        compaction = {"max_chain": args.compaction} if getattr(args, "compaction", 0) and grid else None
        ck = Checkpointer(dmp, load_config({"root": root, "policy": args.policy, "quantization": quant,
                                            "on_busy": "wait", "keep_last": 1, "compaction": compaction}),
                          dense_optimizer=opt, extra_state={"reader": reader})
    curve: dict[int, float] = {}
    labels = _gather(torch.cat([e.labels for e in task.eval]))
    it = iter(reader)
    restore_ms, ckpt_bytes = 0.0, 0
    stats = _SaveStats(sum(task.stream.table_rows))
    tbes = dmp.dirty_tracker.tbes()
    for step in range(1, args.steps + 1):
        set_lr(args, step, opt, tbes)
        loss, _ = dmp(next(it))
        loss.backward()
        opt.step()
        opt.zero_grad()
        reader.step_done()
        interval = getattr(args, "interval", 0)
        if ck is not None and interval and step % interval == 0 and not (points and step == points[0]):
            stats.add(ck.save(step).wait())
            if compaction:  # each compaction folds at the save after it finished: the same folds in every run
                ck.wait(compaction=True)
        if points and step == points[0]:
            points.pop(0)
            assert ck is not None
            t1 = time.perf_counter()
            info = ck.save(step).wait()
            stats.add(info)
            ckpt_bytes += info.nbytes if info is not None else 0
            back = ck.restore()
            restore_ms += (time.perf_counter() - t1) * 1e3
            if back != step or reader.trained != step:
                raise RuntimeError(f"restore after the save of step {step} came back at step {back} with the "
                                   f"reader at {reader.trained}")
            it = iter(reader)
        if step in curve_at:
            curve[step] = float(_losses(eval_logits(dmp, task), labels).mean())
    logits = eval_logits(dmp, task)
    if ck is not None:
        ck.close()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return {"logits": logits, "logloss": float(_losses(logits, labels).mean()), "curve": curve,
            "ckpt_bytes": ckpt_bytes, "save_restore_ms": restore_ms, "wall_s": time.perf_counter() - t0,
            "max_dirty_fraction": stats.max_dirty, "bits_per_row": stats.bits_per_row(), "folds": stats.folds}


class _SaveStats:
    """What a run's saves wrote: the largest dirty fraction of a delta, code bits per stored row, and the
    baselines its deltas hung on that no save wrote (background compactions)."""

    def __init__(self, total_rows: int) -> None:
        self.total_rows = total_rows
        self.max_dirty = 0.0
        self.bits_rows = 0.0
        self.rows = 0
        self.written: set[int] = set()
        self.bases: set[int] = set()

    @property
    def folds(self) -> int:
        return len(self.bases - self.written)

    def add(self, info: Any) -> None:
        if info is None:
            return
        self.written.add(info.id)
        if info.kind != "baseline":
            self.bases.add(info.chain[0])
            self.max_dirty = max(self.max_dirty, info.rows_written / self.total_rows)
        bits = info.codec.get("bits")
        if bits is not None:
            self.bits_rows += bits * info.rows_written
            self.rows += info.rows_written

    def bits_per_row(self) -> float | None:
        return self.bits_rows / self.rows if self.rows else None


def compare(run: dict[str, Any], ref: dict[str, Any], labels: torch.Tensor) -> dict[str, Any]:
    """The run's relative logloss change against the reference, and its paired standard error."""
    diff = _losses(run["logits"], labels) - _losses(ref["logits"], labels)
    n = diff.numel()
    return {"logloss": run["logloss"], "dlogloss_rel": float(diff.mean()) / ref["logloss"],
            "se_rel": float(diff.std()) / math.sqrt(n) / ref["logloss"] if n > 1 else math.nan,
            "identical": bool(torch.equal(run["logits"], ref["logits"])),
            "ckpt_bytes": run["ckpt_bytes"], "save_restore_ms": run["save_restore_ms"], "wall_s": run["wall_s"],
            "max_dirty_fraction": run.get("max_dirty_fraction"), "bits_per_row": run.get("bits_per_row"),
            "folds": run.get("folds", 0)}


def floors(controls: dict[str, dict[str, Any]], restores: list[int]) -> dict[int, float]:
    """Per R, the trajectory floor: the largest |dlogloss_rel| + 2 SE of the fp16/bf16 controls with R restores.

    Those codecs change a value by at most 2^-11 / 2^-8 of itself, less than any codec of the grid: what
    they move the logloss by is what any perturbation of the rows at those steps does, whatever the codec.
    """
    out = {}
    for r in restores:
        got = [abs(c["dlogloss_rel"]) + 2 * c["se_rel"] for k, c in controls.items()
               if k in (f"fp16_{r}", f"bf16_{r}")]
        if got:
            out[r] = max(got)
    return out


def measurable(c: dict[str, Any], floor: float | None) -> bool:
    """Whether a cell stands out of the noise: beyond 2 paired SE and beyond its column's trajectory floor."""
    return abs(c["dlogloss_rel"]) > max(2 * c["se_rel"], floor or 0.0)


def _pct(x: float, digits: int = 3) -> str:
    return f"{x * 100:+.{digits}f}%"


def grid_table(cells: dict[str, dict[str, Any]], controls: dict[str, dict[str, Any]], methods: list[str],
               bits: list[int], restores: list[int], markdown: bool) -> str:
    """Rows method x bits (then the controls), columns R; a cell is dlogloss_rel in percent.

    A cell is marked ``~`` when it is not measurable (see :func:`measurable`), and ``*`` when it is
    beyond the paper's 0.01% although it is measurable.
    """
    fl = floors(controls, restores)
    head = ["method", "bits"] + [f"R={r}" for r in restores]
    rows = []
    for m in methods:
        for b in bits:
            row = [m, str(b)]
            for r in restores:
                c = cells.get(f"{m}_{b}_{r}")
                if c is None:
                    row.append("")
                    continue
                mark = "*" if c["dlogloss_rel"] > PAPER_TOLERANCE and measurable(c, fl.get(r)) else ""
                mark = mark or ("~" if not measurable(c, fl.get(r)) else "")
                row.append(f"{_pct(c['dlogloss_rel'])}{mark}")
            rows.append(row)
    for name in ("fp16", "bf16", "none"):
        got = {r: controls[f"{name}_{r}"] for r in restores if f"{name}_{r}" in controls}
        if got:
            rows.append([f"{name} (control)", {"fp16": "16", "bf16": "16", "none": "32"}[name]]
                        + [_pct(got[r]["dlogloss_rel"]) if r in got else "" for r in restores])
    if fl:
        rows.append(["floor (+/-)", ""] + [f"{fl[r] * 100:.3f}%" if r in fl else "" for r in restores])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(x[i]) for x in [head] + rows) + 2 for i in range(len(head))]
    return "\n".join("".join(x[i].rjust(widths[i]) if i > 1 else x[i].ljust(widths[i]) for i in range(len(head)))
                     for x in [head] + rows)


def rule_check(cells: dict[str, dict[str, Any]], controls: dict[str, dict[str, Any]], methods: list[str],
               bits: list[int], restores: list[int]) -> list[str]:
    """The paper's rule against the grid, and the rule this task gives instead (smallest width per R)."""
    fl = floors(controls, restores)
    lines = []
    for m in methods:
        for b, most in PAPER_RULE.items():
            got = {r: cells[f"{m}_{b}_{r}"] for r in restores if f"{m}_{b}_{r}" in cells and r <= most}
            if not got:
                continue
            bad = [f"R={r}: {_pct(c['dlogloss_rel'])}" for r, c in got.items() if c["dlogloss_rel"] > PAPER_TOLERANCE]
            lines.append(f"paper: {m} {b}-bit survives {most} restore(s) within {PAPER_TOLERANCE:.2%}: "
                         + ("holds" if not bad else "not here (" + ", ".join(bad) + ")"))
    def smallest(m: str, r: int, ok: Any) -> str:
        """The smallest width from which every wider one in the grid is ok ('>max' if even the widest is not)."""
        widths = [b for b in sorted(bits) if f"{m}_{b}_{r}" in cells]
        good = [b for i, b in enumerate(widths) if all(ok(cells[f"{m}_{w}_{r}"]) for w in widths[i:])]
        return str(good[0]) if good else f">{widths[-1]}"

    for m in methods:
        parts = [f"R={r}: {smallest(m, r, lambda c: c['dlogloss_rel'] <= PAPER_TOLERANCE)} "
                 f"({smallest(m, r, lambda c: c['dlogloss_rel'] <= max(2 * c['se_rel'], fl.get(r, 0.0)))})"
                 for r in restores]
        lines.append(f"here, {m}: bits needed for {PAPER_TOLERANCE:.2%} (for no measurable loss): " + "; ".join(parts))
    return lines


# The margin of a recommendation: a width passes at R restores when its cell's dlogloss_rel plus this many
# paired standard errors (one: the upper end of a one-sided 84% interval) is within PAPER_TOLERANCE, or
# within R's trajectory floor where that is larger. Two would make a width whose true cost is 0 fail
# whenever its SE exceeds 0.005%, as a single 4-bit restore's does (0.005-0.007%).
MARGIN_SE = 1.0


def recommend_bits_table(studies: list[dict[str, Any]], method: str = "adaptive") -> dict[int, int]:
    """``bits: auto``'s table from committed studies (their ``--json``): most restores -> bits.

    For each R measured, the smallest width from which every wider width passes (see
    :data:`MARGIN_SE`) in every study; the widest need over the studies wins, and no R needs
    less than a smaller R does (a job that expects more restores gets at least as many bits;
    the config refuses a table that lowers them). Consecutive R that need the same width
    merge into the largest. An R at which no width passes ends the table: beyond its last
    entry, ``bits: auto`` takes ``fallback_bits``.
    """
    need: dict[int, int] = {}
    for study in studies:
        (task, widths), = study["dlogloss"].items()
        floor = study["floor"][task]
        for r in sorted({int(r) for cells in widths.values() for r in cells}):
            ok = []
            for b in sorted(int(k.rsplit("_", 1)[1]) for k in widths if k.rsplit("_", 1)[0] == method):
                cell = study[f"{method}_{b}_{r}"]
                ok.append((b, cell["dlogloss_rel"] + MARGIN_SE * cell["se_rel"] <= max(PAPER_TOLERANCE,
                                                                                        floor.get(str(r), 0.0))))
            passing = [b for i, (b, _) in enumerate(ok) if all(good for _, good in ok[i:])]
            need[r] = max(need.get(r, 0), passing[0]) if passing and need.get(r, 0) != -1 else -1
    table: dict[int, int] = {}
    for r in sorted(need):
        if need[r] == -1:
            break
        bits = max(need[r], table[max(table)]) if table else need[r]
        if table and table[max(table)] == bits:
            del table[max(table)]
        table[r] = bits
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--bits", nargs="+", type=int, default=list(BITS))
    parser.add_argument("--restores", nargs="+", type=int, default=list(RESTORES))
    parser.add_argument("--task", choices=sorted(TASKS), default="harsh",
                        help="harsh: 34,872 rows, saves at the restore points only; production: 1,013,557 rows, "
                             "a checkpoint every 50 steps")
    parser.add_argument("--interval", type=int, default=None,
                        help="checkpoint every N steps besides the restore points (0: only there; default per task)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every run (default 1000)")
    parser.add_argument("--scale", type=float, default=None, help="Criteo cardinalities x this (default 0.001)")
    parser.add_argument("--min-rows", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=None, help="samples per rank and step (default 1024)")
    parser.add_argument("--eval-samples", type=int, default=None, help="held-out samples in all (default 262144)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05, help="peak learning rate of both optimizers")
    parser.add_argument("--schedule", choices=["linear", "constant"], default="linear",
                        help="learning rate over the run: linear decay to 0 (default), or constant")
    parser.add_argument("--signal", type=float, default=2.0)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--row-wise-min-rows", type=int, default=5000)
    parser.add_argument("--policy", choices=["consecutive", "full"], default="consecutive")
    parser.add_argument("--residual", action="store_true",
                        help="quantization.residual: deltas coded against what the chain restores (the grid only)")
    parser.add_argument("--compaction", type=int, default=0, metavar="MAX_CHAIN",
                        help="background compaction of the grid's chains every MAX_CHAIN deltas (0: none); with "
                             "--residual, each compaction is a fold (docs/compaction.md)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sample streams and of the model init of every run (the task, its teacher "
                             "and id law, stays the same); the init-seed control uses seed + 1. "
                             "benchmarks/accuracy_seeds.py combines the seeds")
    parser.add_argument("--no-controls", action="store_true",
                        help="skip the controls (none, fp16 and bf16 restores, another init seed)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny task, 2 and 8 bits, R in {1, 3}")
    parser.add_argument("--out-dir", default=None, help="where checkpoints go while a cell runs (default: $TMPDIR)")
    parser.add_argument("--json", default=None, help='write {"{method}_{bits}_{restores}": {"dlogloss_rel"...}}')
    parser.add_argument("--markdown", default=None, help="write the table as markdown")
    args = parser.parse_args()
    sizes = {"steps": 100, "scale": 0.0005, "batch_size": 256, "eval_samples": 16384} if args.quick else dict(
        TASKS[args.task])
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.interval is None:
        args.interval = sizes.get("interval", 0)
    if args.quick and "--bits" not in sys.argv:
        args.bits = [2, 8]
    if args.quick and "--restores" not in sys.argv:
        args.restores = [1, 3]
    for r in args.restores:
        restore_steps(args.steps, r)  # fail before any training if one does not fit

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        rdzv = tempfile.mktemp(prefix="cnr-accuracy-rdzv-")
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=0, world_size=1)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    t_start = time.perf_counter()
    result = study(args, say)
    wall = time.perf_counter() - t_start
    if rank == 0:
        cells, controls = result["cells"], result["controls"]
        print(f"\ndlogloss_rel of the final eval logloss against no failure, {result['eval']['samples']} eval "
              "samples ('~': not measurable, within 2 paired SE or the column's floor; "
              f"'*': measurable and beyond {PAPER_TOLERANCE:.2%})")
        print(grid_table(cells, controls, args.methods, args.bits, args.restores, markdown=False))
        ses = sorted(c["se_rel"] for c in cells.values())
        print(f"\nnoise: paired standard error of a cell {ses[0] * 100:.4f}% .. {ses[-1] * 100:.4f}% "
              f"(median {ses[len(ses) // 2] * 100:.4f}%); the absolute logloss estimate itself has a standard error "
              f"of {result['unpaired_se_rel'] * 100:.3f}%, and the two eval halves differ by "
              f"{_pct(result['eval_halves_rel'])}")
        for k in ("init_seed_1", f"none_{max(args.restores)}"):
            if k in controls:
                print(f"control {k}: {_pct(controls[k]['dlogloss_rel'])} (se {controls[k]['se_rel'] * 100:.4f}%), "
                      f"logits identical to the reference: {controls[k]['identical']}")
        for line in rule_check(cells, controls, args.methods, args.bits, args.restores):
            print(line)
        print(f"wall time {wall:.0f} s")
        if args.json:
            keep = ("dlogloss_rel", "se_rel", "logloss", "restore_steps", "ckpt_bytes", "save_restore_ms", "wall_s",
                    "max_dirty_fraction", "bits_per_row", "folds")
            out: dict[str, Any] = {k: {x: c[x] for x in keep} for k, c in cells.items()}
            by_width: dict[str, dict[str, Any]] = {}
            bits_per_row: dict[str, dict[str, Any]] = {}
            for c in cells.values():
                by_width.setdefault(f"{c['method']}_{c['bits']}", {})[str(c["restores"])] = c["dlogloss_rel"]
                bits_per_row.setdefault(f"{c['method']}_{c['bits']}", {})[str(c["restores"])] = c["bits_per_row"]
            out["dlogloss"] = {args.task: by_width}
            out["floor"] = {args.task: {str(r): f for r, f in floors(controls, args.restores).items()}}
            out["bits_per_row"] = {args.task: bits_per_row}
            out["_study"] = {
                "reference_logloss": result["reference_logloss"], "learning_curve": result["curve"],
                "eval": result["eval"], "unpaired_se_rel": result["unpaired_se_rel"],
                "eval_halves_rel": result["eval_halves_rel"],
                "floor_rel": {str(r): f for r, f in floors(controls, args.restores).items()},
                "controls": {k: {x: v[x] for x in ("dlogloss_rel", "se_rel", "logloss", "identical")}
                             for k, v in controls.items()},
                "embedding_rows": result["embedding_rows"], "wall_s": wall,
                "config": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        if args.markdown:
            os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
            with open(args.markdown, "w") as f:
                f.write(grid_table(cells, controls, args.methods, args.bits, args.restores, markdown=True) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def study(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    """The reference, the grid and the controls (every rank calls it). Returns the figures (rank 0's are complete)."""
    t0 = time.perf_counter()
    task = make_task(args)
    labels = _gather(torch.cat([e.labels for e in task.eval]))
    rows = sum(task.stream.table_rows)
    say(f"accuracy study, task {args.task} (a checkpoint every {args.interval or 'restore'} step(s)): "
        f"{dist.get_world_size()} rank(s), {args.steps} steps x {args.batch_size} samples/rank, "
        f"lr {args.lr} ({args.schedule}), {rows} embedding rows x {args.dim} (scale {args.scale}), eval on "
        f"{task.eval_detail['samples']} samples, policy {args.policy}; data ready in {time.perf_counter() - t0:.1f} s")
    curve_at = tuple(sorted({max(1, round(args.steps * f / 8)) for f in range(1, 9)}))
    ref = train_run(args, task, curve_at=curve_at)
    say(f"reference (no failure): logloss {ref['logloss']:.5f} in {ref['wall_s']:.1f} s; label entropy "
        f"{task.eval_detail['label_entropy']:.4f}, teacher {task.eval_detail['teacher_logloss']:.4f}")
    say("learning curve (step: eval logloss): " + ", ".join(f"{s}: {v:.5f}" for s, v in ref["curve"].items()))
    l_ref = _losses(ref["logits"], labels)
    half = labels.numel() // 2

    cells: dict[str, dict[str, Any]] = {}
    n = len(args.methods) * len(args.bits) * len(args.restores)
    for m in args.methods:
        for b in args.bits:
            for r in args.restores:
                c = compare(train_run(args, task, method=m, bits=b, restores=r), ref, labels)
                c.update(method=m, bits=b, restores=r, restore_steps=restore_steps(args.steps, r), seeds=[args.seed])
                cells[f"{m}_{b}_{r}"] = c
                say(f"[{len(cells)}/{n}] {m} {b}-bit, {r} restore(s): {_pct(c['dlogloss_rel'])} "
                    f"(se {c['se_rel'] * 100:.4f}%) in {c['wall_s']:.1f} s; largest delta {c['max_dirty_fraction']:.1%} "
                    "of rows")

    controls: dict[str, dict[str, Any]] = {}
    if not args.no_controls:
        # The curve's evals ran inside the reference; `none` (no eval in between) being exact shows they change nothing.
        specs = [(f"none_{max(args.restores)}", {"method": "none", "restores": max(args.restores)})]
        specs += [(f"{m}_{r}", {"method": m, "restores": r}) for m in ("fp16", "bf16") for r in args.restores]
        specs += [("init_seed_1", {"init_seed": args.seed + 1})]  # another init than the reference's
        for name, kwargs in specs:
            controls[name] = compare(train_run(args, task, **kwargs), ref, labels)
            say(f"control {name}: {_pct(controls[name]['dlogloss_rel'])} (se {controls[name]['se_rel'] * 100:.4f}%) "
                f"in {controls[name]['wall_s']:.1f} s")
    return {"cells": cells, "controls": controls, "reference_logloss": ref["logloss"], "curve": ref["curve"],
            "eval": task.eval_detail, "embedding_rows": rows,
            "unpaired_se_rel": float(l_ref.std()) / math.sqrt(labels.numel()) / ref["logloss"],
            "eval_halves_rel": float(l_ref[:half].mean() - l_ref[half:].mean()) / ref["logloss"]}


if __name__ == "__main__":
    main()
