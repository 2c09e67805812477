"""Failure-aware choices: the bit width from expected restores, and the checkpoint interval.

Check-N-Run picks the bit width from the number of restores a job expects, because
quantization error compounds with every restore (the paper: 2 bits survive one, 3 bits
three, 4 bits twenty). ``FailureConfig.bits_table`` holds the widths our own accuracy
studies measured instead (docs/accuracy.md). Once a job has restored more often than it
expected, later saves use ``fallback_bits``.

The interval follows the recovery mode:

* full recovery (every rank rolls back): Young/Daly, ``T = sqrt(2 * C * MTBF)``, with C
  the measured cost of a save to training (its stall) and MTBF from the config;
* partial recovery (CPR: only the failed ranks roll back): a failure loses, on average,
  half an interval of the updates to the failed ranks' share of the rows. With failures
  every MTBF and one rank of ``world_size`` failing each time, the expected lost share of
  updates is ``T / (2 * MTBF * world_size)``; the interval is the longest that keeps it
  under ``target_lost_fraction``: ``T = 2 * MTBF * world_size * target``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from cnr_torchrec.ckpt.config import CheckpointConfig

__all__ = ["IntervalPlan", "IntervalTimer", "bits_for_job", "interval_seconds", "lost_fraction", "plan_interval"]

log = logging.getLogger(__name__)


def bits_for_job(config: CheckpointConfig, restores_done: int) -> tuple[int | None, str]:
    """Bits for the next save, and why. Fixed bits are returned as configured."""
    q, f = config.quantization, config.failure
    if q.bits != "auto":
        return q.bits, "configured"
    expected = f.estimate_restores
    assert expected is not None  # CheckpointConfig refuses bits: auto without an estimate of the restores
    if restores_done > expected:
        return f.fallback_bits, (
            f"{restores_done} restores so far exceed the {expected} expected: fallback_bits {f.fallback_bits}"
        )
    return f.bits_for(expected), f"{expected} restores expected (bits_table {f.bits_table})"


def lost_fraction(interval_s: float, mtbf_s: float, world_size: int) -> float:
    """Expected share of updates lost to failures under partial recovery with this interval."""
    return interval_s / (2.0 * mtbf_s * max(world_size, 1))


def interval_seconds(config: CheckpointConfig, save_cost_s: float, world_size: int) -> tuple[float, str]:
    """The checkpoint interval in seconds for ``interval: auto``, and the numbers behind it."""
    f = config.failure
    mtbf = f.mtbf_s
    if mtbf is None:
        raise ValueError("interval: auto needs failure.mtbf_hours or failure.failure_rate_per_hour")
    if f.recovery == "partial":
        t = 2.0 * mtbf * max(world_size, 1) * f.target_lost_fraction
        why = (f"partial recovery: T = 2 * MTBF {mtbf:.0f} s * world_size {world_size} * target_lost_fraction "
               f"{f.target_lost_fraction:g} = {t:.1f} s")
    else:
        t = math.sqrt(2.0 * max(save_cost_s, 0.0) * mtbf)
        why = f"full recovery (Young/Daly): T = sqrt(2 * C {save_cost_s * 1e3:.1f} ms * MTBF {mtbf:.0f} s) = {t:.1f} s"
    return t, why


@dataclass
class IntervalPlan:
    """When the next save is due, in steps; every rank derives the same one from agreed numbers."""

    interval_steps: int
    next_step: int
    why: str


class IntervalTimer:
    """Measures this rank's step time from the calls of ``should_save``."""

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None
        self._ema: float | None = None

    def observe(self, step: int) -> None:
        now = time.perf_counter()
        if self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1]) / (step - self._last[0])
            self._ema = per_step if self._ema is None else 0.8 * self._ema + 0.2 * per_step
        self._last = (step, now)

    @property
    def step_s(self) -> float:
        """Seconds per step (0.0 until two calls were seen)."""
        return self._ema or 0.0

    def exclude_pause(self, seconds: float) -> None:
        """Leaves time spent outside training (a save's stall) out of the next step time."""
        if self._last is not None:
            self._last = (self._last[0], self._last[1] + seconds)


def plan_interval(
    config: CheckpointConfig, *, step: int, step_s: float, save_cost_s: float, world_size: int
) -> IntervalPlan:
    """The next save step after a save at ``step`` (``interval`` a number or ``auto``)."""
    if config.interval != "auto":
        assert config.interval is not None  # the Checkpointer plans intervals only where one is configured
        n = int(config.interval)
        return IntervalPlan(n, step + n, f"interval: {n} steps")
    seconds, why = interval_seconds(config, save_cost_s, world_size)
    n = max(1, round(seconds / step_s)) if step_s > 0 else 1
    return IntervalPlan(n, step + n, f"{why}; step {step_s * 1e3:.1f} ms -> every {n} steps")
