"""The save decision every rank agrees on: checkpoint id, kind, parent chain and per-table encoding.

Each rank contributes its per-table dirty counts through one all-gather; the decision
is then a pure function of the gathered counts and of the chain state, which every rank
holds identically (it changes only through decisions and commit results that all ranks
see). So no rank ever has to be told the decision.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cnr_torchrec.ckpt.format.writing import ChainLinks

__all__ = ["ChainState", "Decision", "decide", "intermittent_wants_baseline"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainState:
    """What the ranks know about the chain they are extending.

    Attributes:
        next_id: id of the next checkpoint.
        chain: committed ids from the current baseline to the latest checkpoint; empty
            when the next checkpoint must be a baseline.
        baseline_bytes: bytes the current baseline wrote.
        delta_bytes: bytes each delta of the current chain wrote, in order.
    """

    next_id: int = 0
    chain: tuple[int, ...] = ()
    baseline_bytes: int = 0
    delta_bytes: tuple[int, ...] = ()

    def committed(self, decision: Decision, nbytes: int) -> ChainState:
        """The state after ``decision`` committed, having written ``nbytes``."""
        if decision.kind == "baseline":
            return ChainState(decision.ckpt_id + 1, (decision.ckpt_id,), nbytes, ())
        return ChainState(decision.ckpt_id + 1, decision.chain, self.baseline_bytes, self.delta_bytes + (nbytes,))

    def failed(self, decision: Decision) -> ChainState:
        """After a failed save the rows of its interval are gone from the tracker: restart with a baseline."""
        return ChainState(max(self.next_id, decision.ckpt_id + 1))


@dataclass(frozen=True)
class Decision:
    """One save, as agreed by every rank.

    Attributes:
        ckpt_id: the checkpoint's id (its directory is ``ckpt-{id:08d}``).
        step: the training step.
        kind: ``baseline`` (every row) or ``delta``.
        since: for deltas, which rows: ``baseline`` (one-shot) or ``previous`` (consecutive).
        parent: the checkpoint this one applies on top of (None for baselines).
        chain: ids to restore in order, ending with this one.
        encodings: per table, ``full`` (whole shards) or ``rows`` (dirty rows with their ids).
        reason: why this kind was chosen, for the log and the manifest.
        tip: the next background compaction folds the chain up to this checkpoint (not in the manifest).
    """

    ckpt_id: int
    step: int
    kind: Literal["baseline", "delta"]
    since: Literal["baseline", "previous"] | None
    parent: int | None
    chain: tuple[int, ...]
    encodings: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    tip: bool = False  # the next background compaction folds the chain up to this checkpoint

    def links(self) -> ChainLinks:
        """The manifest's chain keys for this decision: the chain as links (its length would grow with it)."""
        return ChainLinks(self.ckpt_id, self.step, self.kind, self.since, self.parent, self.chain[0],
                          len(self.chain) - 1, dict(self.encodings), self.reason)

    def to_json(self) -> dict[str, Any]:
        """:meth:`links` as the manifest writes them."""
        return self.links().to_json()


def intermittent_wants_baseline(baseline_bytes: int, delta_bytes: tuple[int, ...],
                                predicted: float) -> tuple[bool, str]:
    """The intermittent rule: restart the chain once the next delta would raise its average cost.

    A chain that has written a baseline of ``B`` bytes and deltas ``d_1..d_k`` has cost
    ``A = (B + d_1 + ... + d_k) / (k + 1)`` bytes per checkpoint. One-shot deltas only
    grow, so if the next one (``predicted``) costs at least ``A``, continuing can only
    raise the average, while a new baseline starts a chain whose average falls again.
    """
    k = len(delta_bytes)
    average = (baseline_bytes + sum(delta_bytes)) / (k + 1)
    want = k > 0 and predicted >= average
    reason = (
        f"next one-shot delta ~{predicted / 1e6:.2f} MB vs chain average {average / 1e6:.2f} MB "
        f"(baseline {baseline_bytes / 1e6:.2f} MB + {k} deltas {sum(delta_bytes) / 1e6:.2f} MB)"
    )
    return want, reason


def decide(
    *,
    policy: str,
    state: ChainState,
    step: int,
    dirty_since_previous: Mapping[str, int],
    dirty_since_baseline: Mapping[str, int],
    held_rows: Mapping[str, int],
    full_shard_fraction: float,
    force_baseline: str = "",
    since_view: bool = False,
) -> Decision:
    """Chooses the kind, parent and encodings of the next checkpoint.

    Args:
        policy: ``full``, ``one_shot``, ``consecutive`` or ``intermittent``.
        state: the chain state every rank holds.
        step: the training step being saved.
        dirty_since_previous / dirty_since_baseline / held_rows: per table, summed over
            ranks (rows of a table are counted once per rank that holds them).
        full_shard_fraction: dirty share from which a table is written whole.
        force_baseline: a reason to write a baseline regardless of the policy.
        since_view: consecutive only: the chain is a compacted baseline alone, and the delta
            holds the rows of the "since baseline" view (dirty since the compaction's tip).
    """
    full = {t: "full" for t in held_rows}
    if force_baseline or not state.chain or policy == "full":
        reason = force_baseline or ("first checkpoint" if not state.chain else "policy full")
        return Decision(ckpt_id=state.next_id, step=step, kind="baseline", since=None, parent=None,
                        chain=(state.next_id,), encodings=full, reason=reason)

    dirty = dirty_since_previous if policy == "consecutive" and not since_view else dirty_since_baseline
    encodings = {
        t: "full" if rows and dirty.get(t, 0) / rows >= full_shard_fraction else "rows" for t, rows in held_rows.items()
    }
    if policy == "intermittent":
        # Rows the delta would write: whole shards for tables past the threshold, else the dirty rows.
        total = sum(held_rows.values()) or 1
        rows_out = sum(held_rows[t] if encodings[t] == "full" else dirty_since_baseline.get(t, 0) for t in held_rows)
        predicted = state.baseline_bytes * rows_out / total
        want, why = intermittent_wants_baseline(state.baseline_bytes, state.delta_bytes, predicted)
        log.info("intermittent at step %d: %s -> %s", step, why, "new baseline" if want else "delta")
        if want:
            return Decision(ckpt_id=state.next_id, step=step, kind="baseline", since=None, parent=None,
                            chain=(state.next_id,), encodings=full, reason=f"intermittent: {why}")
        reason = f"intermittent: {why}"
    else:
        reason = f"policy {policy}"

    if policy == "consecutive":
        if since_view:
            reason = f"first delta on compacted baseline {state.chain[0]}: the rows dirty since its tip"
        return Decision(ckpt_id=state.next_id, step=step, kind="delta", since="baseline" if since_view else "previous",
                        parent=state.chain[-1], chain=state.chain + (state.next_id,), encodings=encodings,
                        reason=reason)
    return Decision(ckpt_id=state.next_id, step=step, kind="delta", since="baseline", parent=state.chain[0],
                    chain=(state.chain[0], state.next_id), encodings=encodings, reason=reason)

