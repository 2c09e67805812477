"""What the next save hangs on: the chain the ranks extend, kept alike on every rank.

The chain changes only through events every rank sees: a save decided, its outcome settled,
a compaction's outcome, a restore. :class:`ChainBook` holds the committed chain
(:class:`~cnr_torchrec.ckpt.save.planner.ChainState`), what it falls back to should the save in
flight fail (its interval's rows are gone from the tracker by then, so a baseline follows), and
why the next save must be a baseline.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cnr_torchrec.ckpt.save.planner import ChainState, Decision

__all__ = ["ChainBook"]


class ChainBook:
    """The chain state of one Checkpointer.

    Attributes:
        state: the chain the next save extends.
        force_baseline: why the next save must be a baseline; empty when it need not be.
    """

    def __init__(self, next_id: int) -> None:
        self.state = ChainState(next_id=next_id)
        self.force_baseline = ""
        self._if_failed = self.state
        self._settled: set[int] = set()  # ids of the saves whose outcome is folded in
        self._lock = threading.Lock()  # settle() runs on the training thread and in wait()

    def rebase(self, why: str) -> None:
        """The next save must be a baseline, for ``why``."""
        self.force_baseline = why

    def decided(self, decision: Decision) -> None:
        """A save was decided: until its outcome is known, assume it fails."""
        self.force_baseline = ""
        self._if_failed = self.state.failed(decision)

    def settle(self, decision: Decision, nbytes: int | None) -> None:
        """Folds a save's outcome into the chain, once: it committed ``nbytes``, or failed (None)."""
        with self._lock:
            if decision.ckpt_id in self._settled:
                return
            self._settled.add(decision.ckpt_id)
            if nbytes is None:
                self.state = self._if_failed
                self.rebase(f"previous save {decision.ckpt_id} failed")
            else:
                self.state = self.state.committed(decision, nbytes)

    def after_restore(self, chain: Sequence[tuple[int, int]], next_id: int, *, goes_on: bool) -> None:
        """The chain after a restore of ``chain`` ((id, bytes) from its baseline): the next save extends it
        (``goes_on``: policy consecutive), or takes a baseline (the rows dirty since the chain's baseline are
        not in the tracker any more)."""
        if goes_on:
            self.state = ChainState(next_id, tuple(i for i, _ in chain), chain[0][1], tuple(n for _, n in chain[1:]))
        else:
            self.state = ChainState(next_id)
            self.rebase("after restore")
