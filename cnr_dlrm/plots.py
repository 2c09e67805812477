"""Plots of a run's checkpoints, from a ``report.json`` of the training job or from a checkpoint root.

Both sources give the same ``cnr-report`` structure (a root through
:func:`cnr_torchrec.ckpt.tools.summary.summarize`), so one function builds the plotted series
(:func:`build_series`) and one draws them (:func:`make_figures`). Figures are drawn on
matplotlib's Agg canvas directly, without pyplot: nothing global changes and no display
is needed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from cnr_torchrec.errors import CnrError, ConfigError

__all__ = ["PLOTS", "ReportError", "load_report", "validate_report", "build_series", "make_figures", "write_plots"]

PLOTS = ("bytes_per_checkpoint.png", "dirty_fraction.png", "stall_ms.png")

_KIND_COLORS = {"baseline": "#1f77b4", "delta": "#ff7f0e"}
_OTHER_COLOR = "#7f7f7f"


class ReportError(CnrError, ValueError):
    """A report.json that cannot be read or does not follow the ``cnr-report`` schema."""


# Required keys of a report and of each checkpoint row, with the types they may have.
_INT = (int,)
_NUM = (int, float)
_TOP = {"format": (str,), "version": _INT, "world_size": _INT, "full_snapshot_nbytes": _INT, "checkpoints": (list,)}
_ROW = {
    "id": _INT, "step": _INT, "kind": (str,), "method": (str,), "bits": (int, type(None)), "rows_written": _INT,
    "total_rows": _INT, "dirty_fraction": _NUM, "nbytes": _INT, "stall_ms": _NUM, "write_ms": _NUM,
}


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def validate_report(doc: Any, where: str = "report") -> dict[str, Any]:
    """Checks ``doc`` against the ``cnr-report`` version 1 schema (extra keys are allowed and ignored).

    Raises:
        ReportError: naming the first key that is missing or of the wrong type.
    """
    if not isinstance(doc, dict):
        raise ReportError(f"{where} is not a JSON object; expected a cnr-report written by the training job")
    if doc.get("format") != "cnr-report":
        raise ReportError(f"{where} has format {doc.get('format')!r}, not 'cnr-report'; pass a report.json written "
                          "by the training job, or a checkpoint root")
    if doc.get("version") != 1:
        raise ReportError(f"{where} has version {doc.get('version')!r}; this build reads version 1")
    for key, types in _TOP.items():
        if not _type_ok(doc.get(key), types):
            raise ReportError(f"{where}: key {key!r} is missing or not {'/'.join(t.__name__ for t in types)}")
    for i, row in enumerate(doc["checkpoints"]):
        if not isinstance(row, dict):
            raise ReportError(f"{where}: checkpoints[{i}] is not an object")
        for key, types in _ROW.items():
            if key not in row or not _type_ok(row[key], types):
                raise ReportError(f"{where}: checkpoints[{i}].{key} is missing or not "
                                  f"{'/'.join(t.__name__ for t in types)}")
    return doc


def load_report(path: str) -> dict[str, Any]:
    """Reads and validates a ``report.json``.

    Raises:
        ReportError: the file cannot be read, is not JSON, or does not follow the schema.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ReportError(f"cannot read {path}: {e.strerror or e}; pass a report.json or a checkpoint root") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path} is not valid JSON ({e}); pass the report.json the training job wrote") from None
    return validate_report(doc, path)


def build_series(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The data each plot shows, checkpoints in id order.

    Returns:
        ``{"bytes": {"ids", "nbytes", "kinds", "full_snapshot_nbytes"},
        "dirty": {"steps", "dirty_fraction", "kinds"}, "stall": {"ids", "stall_ms", "kinds"}}``.
    """
    rows = sorted(report["checkpoints"], key=lambda r: r["id"])
    ids = [int(r["id"]) for r in rows]
    kinds = [str(r["kind"]) for r in rows]
    return {
        "bytes": {"ids": ids, "nbytes": [int(r["nbytes"]) for r in rows], "kinds": kinds,
                  "full_snapshot_nbytes": int(report["full_snapshot_nbytes"])},
        "dirty": {"steps": [int(r["step"]) for r in rows], "dirty_fraction": [float(r["dirty_fraction"]) for r in rows],
                  "kinds": kinds},
        "stall": {"ids": ids, "stall_ms": [float(r["stall_ms"]) for r in rows], "kinds": kinds},
    }


def _colors(kinds: list[str]) -> list[str]:
    return [_KIND_COLORS.get(k, _OTHER_COLOR) for k in kinds]


def _legend(ax: Any, kinds: list[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in _KIND_COLORS.items() if k in kinds]
    if handles:
        ax.legend(handles=handles + ax.get_legend_handles_labels()[0], loc="best", fontsize="small")


def _axes(xlabel: str, ylabel: str, title: str):
    """A new figure on an Agg canvas (no pyplot state) and its labelled axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return fig, ax


def _bars(ids: list[int], heights: list[float], kinds: list[str], ylabel: str, title: str):
    """Bars per checkpoint id, coloured by kind."""
    fig, ax = _axes("checkpoint id", ylabel, title)
    pos = list(range(len(ids)))
    ax.bar(pos, heights, color=_colors(kinds))
    ax.set_xticks(pos, [str(i) for i in ids])
    return fig, ax


def make_figures(report: Mapping[str, Any]) -> dict[str, Any]:
    """The three figures, by file name (see :data:`PLOTS`), drawn on Agg canvases."""
    s = build_series(report)
    b, d, st = s["bytes"], s["dirty"], s["stall"]

    bytes_fig, ax = _bars(b["ids"], b["nbytes"], b["kinds"], "bytes", "bytes per checkpoint vs a full fp32 snapshot")
    if b["full_snapshot_nbytes"] > 0:
        ax.axhline(b["full_snapshot_nbytes"], color="black", linestyle="--", label="full fp32 snapshot")
    ax.set_yscale("log")
    _legend(ax, b["kinds"])

    dirty_fig, ax = _axes("step", "rows written / rows held", "dirty fraction per checkpoint")
    ax.plot(d["steps"], d["dirty_fraction"], color="#555555", linewidth=1, zorder=1)
    ax.scatter(d["steps"], d["dirty_fraction"], c=_colors(d["kinds"]), zorder=2)
    ax.set_ylim(0, max([1.0] + d["dirty_fraction"]) * 1.05)
    _legend(ax, d["kinds"])

    stall_fig, ax = _bars(st["ids"], st["stall_ms"], st["kinds"], "ms", "training stall per checkpoint")
    _legend(ax, st["kinds"])

    figs = dict(zip(PLOTS, (bytes_fig, dirty_fig, stall_fig)))
    for fig in figs.values():
        fig.tight_layout()
    return figs


def write_plots(report: Mapping[str, Any], out_dir: str) -> list[str]:
    """Writes the three PNGs into ``out_dir`` (created if needed); returns their paths.

    Raises:
        ConfigError: matplotlib (the ``plot`` extra) is not installed.
    """
    try:
        import matplotlib  # noqa: F401  (an optional dependency: the `plot` extra)
    except ImportError as e:
        raise ConfigError(
            f"the plots need matplotlib, which this environment lacks ({e}); install it with "
            "`pip install matplotlib`, or install cnr_torchrec with its `plot` extra"
        ) from None
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in make_figures(report).items():
        path = os.path.join(out_dir, name)
        fig.savefig(path, format="png")
        paths.append(path)
    return paths
