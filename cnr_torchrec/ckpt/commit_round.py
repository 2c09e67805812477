"""Rank 0 commits, every rank hears: the one round over the c10d store that a save's commit and a background
compaction's commit both run.

A round is named by a key prefix (``"7"`` for save 7, ``"compact/12"`` for compaction 12) and goes:

1. **On every rank**, once its own part is written (or has failed), :meth:`CommitRound.run` with its
   :class:`Report`.
2. **On every rank but 0**: the report goes into the store (``<prefix>/report/<rank>``); the rank then waits
   for ``<prefix>/result`` and reads rank 0's :class:`Outcome`. A rank that hears nothing within twice the
   timeout (rank 0 died, or its store with it) gets an outcome with ``heard=False``: rank 0 may have committed.
   Twice: rank 0 may wait the whole timeout for a silent rank's report before it decides, and its verdict
   must still find the ranks listening.
3. **On rank 0 only**: it waits for every other rank's report; a rank silent past the timeout counts as a
   failed report naming it. It reads the reports, deletes their keys, and calls the caller's ``commit`` with
   all of them, its own first, which decides (writes the manifest, or not) and returns the outcome; a
   ``commit`` that raises is a failed outcome naming the error. Rank 0 then publishes the outcome; an outcome
   it could not publish is a failure on rank 0 too (the others give up at their timeout and count it failed).
4. **On every rank but 0**, having read the outcome: it counts itself as having heard; the last one deletes
   the result and the count, so the store holds nothing of a finished round.

Waiting polls the store (``check``) rather than blocking in ``wait``: the save thread and the compaction
thread share one store client, and a blocking wait in one would hold it from the other.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cnr_torchrec.ckpt._collective import heard

__all__ = ["CommitRound", "Outcome", "Peers", "Report"]

log = logging.getLogger(__name__)

POLL_S = 0.05


@dataclass(frozen=True)
class Report:
    """What one rank tells rank 0: whether its part is written (``ok``), why not (``error``), and the part's
    record for the manifest (``part``: what :func:`~cnr_torchrec.ckpt.format.parts.write_part` returned)."""

    rank: int
    ok: bool
    error: str = ""
    part: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def failed(cls, rank: int, error: str) -> Report:
        return cls(rank, False, error)

    @classmethod
    def of_part(cls, part: Mapping[str, Any]) -> Report:
        """The report of a written part (or of a failed one: ``{"rank", "ok": False, "error"}``)."""
        return cls(int(part["rank"]), bool(part["ok"]), str(part.get("error", "")), part)

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "ok": self.ok, "error": self.error, "part": dict(self.part)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Report:
        raw = json.loads(text)
        return cls(int(raw["rank"]), bool(raw["ok"]), str(raw["error"]), raw["part"])


@dataclass(frozen=True)
class Outcome:
    """What every rank learns of a round: committed (``ok``) or why not (``error``); ``heard`` false where this
    rank heard nothing from rank 0 (which may have committed); ``facts``: what rank 0 says of the commit (JSON:
    its bytes, rows, timings); ``manifest``: on rank 0 only, the manifest it committed (never sent)."""

    ok: bool
    error: str = ""
    heard: bool = True
    facts: Mapping[str, Any] = field(default_factory=dict)
    manifest: Any = field(default=None, compare=False)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "error": self.error, "facts": dict(self.facts)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Outcome:
        raw = json.loads(text)
        return cls(bool(raw["ok"]), str(raw["error"]), True, raw["facts"])


@dataclass(frozen=True)
class Peers:
    """Who a job's rounds run among: this rank of ``world_size``, over the c10d ``store`` (None on one process),
    each wait bounded by ``timeout_s``. A Checkpointer builds it once; its saves and compactions run their
    rounds with it."""

    store: Any
    rank: int
    world_size: int
    timeout_s: float

    def round(self, prefix: str) -> CommitRound:
        """The round named ``prefix`` among these ranks."""
        return CommitRound(self.store, prefix, self.rank, self.world_size, self.timeout_s)


class CommitRound:
    """One round (see the module's steps) over ``store`` under ``prefix``, on ``rank`` of ``world_size``, each
    wait bounded by ``timeout_s``. A single-rank job (no store) has rank 0 commit alone."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
        self._store, self._prefix = store, prefix
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s

    def run(self, own: Report, commit: Callable[[list[Report]], Outcome]) -> Outcome:
        """Step 1: this rank's part of the round. Never raises: every failure is an outcome."""
        if self.rank != 0:
            return self._hear(own)
        try:
            out = commit(self._gather(own))
        except Exception as e:
            log.error("%s: rank 0 could not commit", self._prefix, exc_info=True)
            out = Outcome(False, f"rank 0 could not commit: {type(e).__name__}: {e}")
        return self._publish(out)

    def _key(self, what: str) -> str:
        return f"{self._prefix}/{what}"

    def _wait(self, keys: list[str], timeout_s: float) -> bool:
        """Polls until every key is set (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _hear(self, own: Report) -> Outcome:
        """Step 2 (ranks but 0) and step 4."""
        try:
            self._store.set(self._key(f"report/{self.rank}"), own.to_json())
            if not self._wait([self._key("result")], 2 * self.timeout_s):
                return Outcome(False, f"no word from rank 0 within {2 * self.timeout_s:g} s", heard=False)
            out = Outcome.from_json(self._store.get(self._key("result")))
        except Exception as e:  # the store lives in rank 0's process under some launchers: it may be gone with it
            return Outcome(False, f"no word from rank 0 ({type(e).__name__}: {e})", heard=False)
        heard(self._store, self._key("result"), self._key("heard"), self.world_size)
        return out

    def _gather(self, own: Report) -> list[Report]:
        """Step 3, rank 0: every rank's report, its own first; a rank silent past the timeout fails by name."""
        if self.world_size == 1:
            return [own]
        keys = {r: self._key(f"report/{r}") for r in range(1, self.world_size)}
        self._wait(list(keys.values()), self.timeout_s)
        reports = [own]
        for r, k in keys.items():
            if not self._store.check([k]):
                reports.append(Report.failed(r, f"no report within {self.timeout_s:g} s"))
                continue
            reports.append(Report.from_json(self._store.get(k)))
            self._store.delete_key(k)  # read: the store need not hold it any longer
        return reports

    def _publish(self, out: Outcome) -> Outcome:
        """Step 3, rank 0: tells the others ``out``; returns it, or a failure where they could not be told."""
        if self.world_size == 1:
            return out
        try:
            self._store.set(self._key("result"), out.to_json())
        except Exception as e:
            log.error("%s: rank 0 could not tell the other ranks the outcome: %s: %s", self._prefix,
                      type(e).__name__, e)
            return Outcome(False, f"rank 0 could not tell the other ranks the outcome ({type(e).__name__}: {e})")
        return out
