"""Accuracy studies under several seeds, combined: the tables ``bits: auto`` derives from.

Run:  python benchmarks/accuracy_seeds.py out/accuracy-harsh.json out/accuracy-harsh-s1.json ...
          [--controls-from JSON ...] [--json PATH] [--markdown PATH]        (no training; seconds)

Each input is one ``benchmarks/accuracy.py --json`` run of the same task and arm under its own
``--seed``. Each cell of the result is the mean over the seeds, with

* ``paired_se_rel``: the pooled paired standard error of that mean, ``sqrt(sum se_i^2) / n``;
* ``seed_se_rel``: the seeds' spread, ``sd / sqrt(n)`` (it holds the training trajectories' spread too);
* ``se_rel``: the larger of the two, which the margin of ``recommend_bits_table`` uses.

The controls are combined over the runs that have them (``--no-controls`` saves them in the other
seeds), and the floors come from the combined controls. The result has the shape of one study's
JSON, so :func:`accuracy.recommend_bits_table` and ``grid_table`` read it as they read one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy import floors, grid_table  # noqa: E402

__all__ = ["combine_seeds"]


def _combine_cells(cells: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """One cell over independent seeds: the mean change, the pooled paired SE of that mean, the SE of the
    seeds' spread, and ``se_rel``, the larger of the two (what the margins use)."""
    n = len(cells)
    d = [c["dlogloss_rel"] for c in cells]
    mean = sum(d) / n
    paired = math.sqrt(sum(c["se_rel"] ** 2 for c in cells)) / n
    spread = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else math.nan
    out = {"dlogloss_rel": mean, "paired_se_rel": paired, "seed_se_rel": spread,
           "se_rel": max(paired, spread) if n > 1 else paired, "seeds": seeds, "per_seed": d}
    for k in ("bits_per_row", "max_dirty_fraction", "folds"):
        vals = [c.get(k) for c in cells if c.get(k) is not None]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


# Config keys that do not change what a cell measures (a study of more methods holds the same adaptive cells),
# and the defaults of keys older studies lack.
_RUN_ONLY = ("seed", "no_controls", "out_dir", "methods", "combine", "controls_from")  # (older studies: the last two)
_DEFAULTS = {"seed": 0, "compaction": 0, "residual": False}


def combine_seeds(studies: list[dict[str, Any]], controls_from: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """Studies of one task and arm under several ``--seed`` (their ``--json``), as one study of the same shape:
    each cell over the seeds (:func:`_combine_cells`), each control over the studies that ran the controls
    (``--no-controls`` saves them in the other seeds), and the floors from the combined controls.

    ``controls_from``: studies of another arm of the same task whose controls stand in. The controls
    (fp32, fp16 and bf16 restores, another init) use neither residual coding nor compaction nor the grid's
    widths, so an arm that differs only in those runs the very same control runs.
    """
    configs = [{**_DEFAULTS, **s["_study"]["config"]} for s in studies]
    seeds = [c["seed"] for c in configs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {seeds} repeat: combine studies of distinct --seed")
    same = {k: v for k, v in configs[0].items() if k not in _RUN_ONLY}
    for c in configs[1:]:
        other = {k: v for k, v in c.items() if k not in _RUN_ONLY}
        if other != same:
            diff = sorted(k for k in set(same) | set(other) if same.get(k) != other.get(k))
            raise ValueError(f"studies differ in {diff}: combine runs of one task and arm only")
    task = configs[0]["task"]
    keys = [k for k in studies[0] if not k.startswith("_") and k not in ("dlogloss", "floor", "bits_per_row")
            and all(k in s for s in studies)]  # the cells every study ran
    out: dict[str, Any] = {k: _combine_cells([s[k] for s in studies], seeds) for k in keys}
    with_controls = [(s, seed) for s, seed in zip(studies, seeds) if s["_study"]["controls"]]
    for other in controls_from:
        cfg = {**_DEFAULTS, **other["_study"]["config"]}
        arm = ("residual", "compaction", "bits")
        mismatch = sorted(k for k in set(same) | set(cfg)
                          if k not in _RUN_ONLY and k not in arm and same.get(k) != cfg.get(k))
        if mismatch:
            raise ValueError(f"--controls-from: a study that differs in {mismatch}, not only in {list(arm)}")
        with_controls.append((other, cfg["seed"]))
    if not with_controls:
        raise ValueError("none of the studies ran the controls: run one seed without --no-controls")
    controls = {k: _combine_cells([s["_study"]["controls"][k] for s, _ in with_controls],
                                  [seed for _, seed in with_controls])
                for k in with_controls[0][0]["_study"]["controls"]}
    restores = sorted({int(k.rsplit("_", 1)[1]) for k in keys})
    fl = floors(controls, restores)
    by_width: dict[str, dict[str, Any]] = {}
    bits_per_row: dict[str, dict[str, Any]] = {}
    for k, c in out.items():
        width, r = k.rsplit("_", 1)
        by_width.setdefault(width, {})[r] = c["dlogloss_rel"]
        bits_per_row.setdefault(width, {})[r] = c.get("bits_per_row")
    out["dlogloss"] = {task: by_width}
    out["floor"] = {task: {str(r): f for r, f in fl.items()}}
    out["bits_per_row"] = {task: bits_per_row}
    methods = sorted({k.rsplit("_", 2)[0] for k in keys})
    out["_study"] = {"seeds": seeds, "controls": controls, "floor_rel": {str(r): f for r, f in fl.items()},
                     "reference_logloss": [s["_study"]["reference_logloss"] for s in studies],
                     "wall_s": sum(s["_study"]["wall_s"] for s in studies),
                     "config": {**same, "methods": methods, "seeds": seeds}}
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("studies", nargs="+", metavar="JSON",
                        help="studies of one task and arm (benchmarks/accuracy.py --json), each under its own --seed")
    parser.add_argument("--controls-from", nargs="+", default=[], metavar="JSON",
                        help="take the controls from these studies of another arm of the task (the controls use "
                             "neither residual coding nor compaction)")
    parser.add_argument("--json", default=None, help="write the combined study")
    parser.add_argument("--markdown", default=None, help="write its table as markdown")
    return parser


def main() -> None:
    args = _parser().parse_args()
    studies = []
    for path in args.studies:
        with open(path) as f:
            studies.append(json.load(f))
    extra = []
    for path in args.controls_from:
        with open(path) as f:
            extra.append(json.load(f))
    out = combine_seeds(studies, extra)
    cfg = out["_study"]["config"]
    cells = {k: v for k, v in out.items() if not k.startswith("_") and k not in ("dlogloss", "floor", "bits_per_row")}
    restores = sorted({int(k.rsplit("_", 1)[1]) for k in cells})
    table = grid_table(cells, out["_study"]["controls"], cfg["methods"], cfg["bits"], restores, markdown=False)
    print(f"task {cfg['task']}{' residual' if cfg.get('residual') else ''}"
          f"{' compaction ' + str(cfg['compaction']) if cfg.get('compaction') else ''}, seeds {cfg['seeds']}:\n{table}")
    ses = sorted(c["paired_se_rel"] for k, c in cells.items() if int(k.rsplit("_", 1)[1]) <= 3)
    print(f"paired SE of a cell at R <= 3: {ses[0] * 100:.4f}% .. {ses[-1] * 100:.4f}%")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(grid_table(cells, out["_study"]["controls"], cfg["methods"], cfg["bits"], restores,
                               markdown=True) + "\n")


if __name__ == "__main__":
    main()
