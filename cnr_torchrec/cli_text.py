"""What ``cnr`` prints about a root, as text: byte counts, codecs, the checkpoint table and chain lines of
``cnr inspect``, id runs. Pure formatting of the summaries the tools build (:mod:`cnr_torchrec.cli` runs the
commands and prints these)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["chain_lines", "checkpoint_table", "codec_label", "dense_optimizer_label", "human_bytes", "id_ranges",
           "inspect_text"]


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def codec_label(method: str | None, bits: int | None) -> str:
    if method is None:
        return "?"
    return method if bits is None else f"{method}/{bits}"



def dense_optimizer_label(info: dict[str, Any] | None, short: bool = False) -> str:
    """A checkpoint's dense optimizer state in words: ``none``, or ``kind (class)`` (``short``: the class's own
    name, without its module)."""
    if info is None:
        return "none"
    cls = info.get("class")
    if cls is None:
        return f"{info['kind']} (class not recorded)"
    return f"{info['kind']} ({cls.rsplit('.', 1)[-1] if short else cls})"


def checkpoint_table(rows: list[dict[str, Any]], full: int) -> list[str]:
    """One line per checkpoint; its chain as ``base..id (length)``, whatever the chain's length."""
    header = ("id", "step", "kind", "policy", "chain", "codec", "bytes", "% full", "rows", "dirty", "stall ms",
              "write ms", "dense optimizer")
    table = [header]
    for r in rows:
        table.append((
            str(r["id"]), str(r["step"]), r["kind"], str(r["policy"]),
            f"{r['base']}..{r['id']} ({r['depth'] + 1}{'' if r['broken_member'] is None else ', broken'})",
            codec_label(r["method"], r["bits"]), human_bytes(r["nbytes"]),
            f"{100 * r['nbytes'] / full:.1f}" if full else "-", f"{r['rows_written']}/{r['total_rows']}",
            f"{100 * r['dirty_fraction']:.1f}%", f"{r['stall_ms']:.1f}", f"{r['write_ms']:.1f}",
            dense_optimizer_label(r.get("dense_optimizer"), short=True),
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    left = {2, 3, 4, 5, 12}
    return ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in table]


def broken(r: dict[str, Any], corrupt: set[int]) -> str:
    """Why checkpoint ``r`` cannot be restored (its chain lacks a member), in a few words."""
    m = r["broken_member"]
    return f"checkpoint {m} of its chain is {'corrupt (below)' if m in corrupt else 'not committed'}"


def chain_lines(rows: list[dict[str, Any]], corrupt: set[int]) -> list[str]:
    """One line per chain (a baseline and the deltas on it), however many deltas it holds. A delta restores
    only if every member of its chain loads; ``corrupt`` holds the ids whose manifest does not."""
    by_id = {r["id"]: r for r in rows}
    on: dict[int, list[dict[str, Any]]] = {}
    for d in rows:
        if d["kind"] == "delta":
            on.setdefault(d["base"], []).append(d)
    lines = []
    for r in rows:
        if r["kind"] != "baseline":
            continue
        deltas = on.get(r["id"], [])
        note = ""
        if r.get("compacted_from"):
            first, tip = r["compacted_from"][0], r["compacted_from"][-1]
            note = f", compacted from chain {first}..{tip}; restores what {tip} restores"
        if deltas:
            newest = max(deltas, key=lambda d: (d["step"], d["id"]))
            held = human_bytes(r["nbytes"] + sum(d["nbytes"] for d in deltas))
            what = (f"{len(deltas)} delta(s) {deltas[0]['id']}..{deltas[-1]['id']}, the newest {newest['id']} (step "
                    f"{newest['step']}) ")
            if newest["broken_member"] is None:
                what += f"restores {newest['depth'] + 1} checkpoint(s)"
            else:
                sound = [d for d in deltas if d["broken_member"] is None]
                best = max(sound, key=lambda d: (d["step"], d["id"])) if sound else None
                what += f"cannot be restored: {broken(newest, corrupt)}; " + (
                    f"the newest that restores is {best['id']} (step {best['step']}, {best['depth'] + 1} "
                    "checkpoint(s))" if best else f"only baseline {r['id']} itself restores")
            what += f"; {held} in all"
        else:
            what = "no deltas"
        lines.append(f"  baseline {r['id']} (step {r['step']}{note}): {what}")
    for d in rows:
        if d["kind"] == "delta" and d["base"] not in by_id:
            state = "corrupt (below)" if d["base"] in corrupt else "not committed"
            lines.append(f"  delta {d['id']} hangs on baseline {d['base']}, which is {state} (it cannot be "
                         "restored)")
    return lines


def inspect_text(summary: dict[str, Any], last: int | None) -> str:
    rows = summary["checkpoints"]
    lines = [f"root {summary['root']}: {len(rows)} committed checkpoint(s), world size {summary['world_size']}"]
    origin = summary.get("origin")
    if origin:
        lines.append(f"warm-started from {origin['root']} (checkpoint {origin['ckpt']}, step {origin['step']}; "
                     f"{len(origin['tables'])} table(s); mapping sha256 {str(origin['mapping_digest'])[:16]})")
    shown = rows if last is None or len(rows) <= last else rows[-last:]
    if len(shown) < len(rows):
        lines.append(f"(the newest {len(shown)} by id; {len(rows) - len(shown)} older ones not shown: --all shows "
                     "every one)")
    lines += checkpoint_table(shown, summary["full_snapshot_nbytes"])
    lines.append("")
    lines.append("chains (a restore applies the chain's baseline, then its deltas in order):")
    lines += chain_lines(rows, {c["id"] for c in summary["corrupt"]})
    total, full = summary["total_nbytes"], summary["full_snapshot_nbytes"]
    lines.append("")
    lines.append(
        f"total {human_bytes(total)} in {len(rows)} checkpoint(s); a full fp32 snapshot of the tables and their "
        f"optimizer state is {human_bytes(full)} (tables alone {human_bytes(summary['full_snapshot_table_nbytes'])})"
        + (f": {total / full:.2f} snapshots' worth" if full else "")
    )
    if summary.get("reconstruction_nbytes"):
        lines.append(f"residual chain: a job that resumes it keeps a float32 copy of its shards in host memory, "
                     f"{human_bytes(summary['reconstruction_nbytes'])} over its {summary['world_size']} rank(s)")
    for c in summary["corrupt"]:
        lines.append(f"corrupt: checkpoint {c['id']}: {c['message']}")
    for r in rows:
        for f in r.get("missing_files", ()):
            lines.append(f"missing: checkpoint {r['id']}: {f} is not there (the storage lost it); this checkpoint "
                         "and the deltas on it cannot be restored")
    newest = summary.get("newest_restorable")
    if rows and newest != rows[-1]["id"]:
        lines.append("a restore takes " + (f"checkpoint {newest}" if newest is not None else "no checkpoint")
                     + "; it finds unsound " + "; ".join(f"checkpoint {u['id']} ({u['why']})"
                                                        for u in summary.get("unrestorable", ())))
    for u in summary["uncommitted"]:
        files = ", ".join(f"{os.path.basename(f)} {human_bytes(n)}" for f, n in u["files"].items()) or "empty"
        lines.append(f"uncommitted (torn): ckpt-{u['id']:08d} ({files}): a save that did not commit or is still "
                     "writing; restore ignores it")
    return "\n".join(lines)



def id_ranges(ids: list[int]) -> str:
    """Sorted ids as runs: ``0-3, 7``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
