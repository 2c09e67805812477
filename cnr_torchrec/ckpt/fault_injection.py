"""Fault injection: named points in the save path where a test can SIGKILL the process, or stall it.

Kill tests need crashes at exact moments of the commit protocol (a half-written rank
file, a commit that stopped just before or after the manifest rename, a garbage
collection cut short), which a timer hits only by luck. The save path calls
:func:`hit` at each such moment; it does nothing unless the environment variable
``CNR_FAULT`` names that point::

    CNR_FAULT=commit.before_manifest                  # the first time any rank gets there
    CNR_FAULT=write.mid:rank=1:nth=3                  # the 3rd time rank 1 gets there
    CNR_FAULT=write.after:rank=0,gc.mid:nth=2         # several points, comma-separated
    CNR_FAULT=write.mid:local_rank=1:nth=2            # by LOCAL_RANK (one node of a torchrun job)
    CNR_FAULT=image.mid:rank=1:pause=1500             # no kill: that thread stalls there for 1.5 s

A fault stands for one crash; ``pause=<ms>`` makes it a stall instead, for tests of what the
process does while that step is under way (a job that exits in the middle of it, say). Under
torchrun, workers that an agent restarted after a failure (``TORCHELASTIC_RESTART_COUNT`` above 0)
arm nothing, so the restarted job can finish.

The variable is read once, when this module is imported (:func:`configure` re-reads it,
for harnesses that fork workers from a process that imported it earlier). With nothing
armed, :func:`hit` is one dict lookup on an empty dict.

Points (see :data:`POINTS`):

* ``write.mid``: a rank file is half written (the storage layer writes the first half,
  then stops here).
* ``write.after``: the rank file is written and fsynced; the rank has not reported yet.
* ``commit.before_manifest``: rank 0 has every report; the manifest is not written.
* ``commit.after_manifest``: the manifest is renamed into place (committed); nobody has
  been told, index.json is not rewritten, nothing is collected.
* ``gc.before``: the commit is published to every rank; garbage collection has not begun.
* ``gc.mid``: garbage collection (or the cleanup of a failed save) has deleted the first
  file of a checkpoint directory and stops before the rest.
* ``compact.after_write``: a rank has written its file of a background compaction and not
  reported yet (training goes on meanwhile).
* ``compact.before_manifest``: rank 0 has every compaction report; its manifest is not written.
* ``compact.after_manifest``: the compacted baseline is committed; nobody has been told,
  and the deltas still hang on the old chain.
* ``image.unsealed``: a save has committed and the rank's memory image has lost its seal; no row
  of it has changed yet.
* ``image.mid``: the memory image holds the committed save's rows for its first shard only.
* ``image.updated``: the memory image holds every row of the committed save, and is not sealed yet.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from cnr_torchrec.errors import ConfigError

__all__ = ["ENV", "POINTS", "FaultSpec", "armed", "configure", "hit", "parse"]

log = logging.getLogger(__name__)

ENV = "CNR_FAULT"
POINTS: tuple[str, ...] = (
    "write.mid",
    "write.after",
    "commit.before_manifest",
    "commit.after_manifest",
    "gc.before",
    "gc.mid",
    "compact.after_write",
    "compact.before_manifest",
    "compact.after_manifest",
    "image.unsealed",
    "image.mid",
    "image.updated",
)


@dataclass(frozen=True)
class FaultSpec:
    """Kill the process the ``nth`` time it reaches ``point`` (only on ``rank`` and ``local_rank``, if given),
    or with ``pause_ms`` stall the thread that got there for that long instead."""

    point: str
    rank: int | None = None
    nth: int = 1
    local_rank: int | None = None
    pause_ms: int | None = None

    def __str__(self) -> str:
        opts = (("rank", self.rank), ("local_rank", self.local_rank))
        where = "".join(f":{k}={v}" for k, v in opts if v is not None)
        pause = "" if self.pause_ms is None else f":pause={self.pause_ms}"
        return f"{self.point}{where}:nth={self.nth}{pause}"

    def matches(self, rank: int, local_rank: int) -> bool:
        return self.rank in (None, rank) and self.local_rank in (None, local_rank)


def parse(text: str | None) -> list[FaultSpec]:
    """Parses a ``CNR_FAULT`` value.

    Raises:
        ConfigError: an unknown point or option, or a rank/nth/pause that is not a whole number
            (a misspelt fault would otherwise never fire and the test would prove nothing).
    """
    specs = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        point, *opts = item.split(":")
        if point not in POINTS:
            raise ConfigError(f"{ENV}: unknown fault point {point!r}; choose one of {list(POINTS)}")
        kw: dict[str, int] = {}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in ("rank", "local_rank", "nth", "pause") or not value.strip().isdigit():
                raise ConfigError(f"{ENV}: {opt!r} in {item!r} is not rank=<int>, local_rank=<int>, nth=<int> or "
                                  "pause=<ms>")
            kw["pause_ms" if key == "pause" else key] = int(value)
        if kw.get("nth", 1) < 1:
            raise ConfigError(f"{ENV}: nth counts from 1, got {kw['nth']} in {item!r}")
        specs.append(FaultSpec(point, **kw))
    return specs


_armed: dict[str, list[FaultSpec]] = {}
_counts: dict[str, int] = {}


def configure(text: str | None = None) -> list[FaultSpec]:
    """Arms the faults in ``text`` (default: re-read ``CNR_FAULT``) and resets the hit counters.

    Reading the environment under a restarted torchrun worker arms nothing (the crash it
    describes has happened); the specs are still parsed, so a misspelt one fails every time.
    """
    specs = parse(os.environ.get(ENV) if text is None else text)
    if text is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        if specs:
            log.info("%s ignored: this worker was restarted after a failure", ENV)
        specs = []
    _armed.clear()
    _counts.clear()
    for s in specs:
        _armed.setdefault(s.point, []).append(s)
    return specs


def armed(point: str) -> bool:
    """True if some fault names ``point`` (the storage layer then writes in two halves)."""
    return point in _armed


def hit(point: str) -> None:
    """Kills this process with SIGKILL (or stalls the calling thread, for a ``pause``) if a fault is armed for
    the count-th arrival at ``point``."""
    specs = _armed.get(point)
    if not specs:
        return
    rank, local_rank = _rank(), int(os.environ.get("LOCAL_RANK", "0") or 0)
    mine = [s for s in specs if s.matches(rank, local_rank)]
    if not mine:
        return
    n = _counts[point] = _counts.get(point, 0) + 1
    for s in mine:
        if s.nth == n and s.pause_ms is not None:
            log.warning("fault %s: rank %s stalls for %d ms", s, rank, s.pause_ms)
            time.sleep(s.pause_ms / 1e3)
        elif s.nth == n:
            log.warning("fault %s: killing rank %s (pid %d)", s, rank, os.getpid())
            _kill()


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a rank we cannot tell is rank 0, like RANK unset
        pass
    return int(os.environ.get("RANK", "0"))


def _kill() -> None:
    """SIGKILL: no handler, no atexit, no flush, exactly what a machine or OOM-killer loss looks like."""
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    os.kill(os.getpid(), signal.SIGKILL)


configure()
