"""Whether a job codes its deltas as residuals: ``quantization.residual`` true, false or ``auto``.

Residual coding keeps Check-N-Run's accuracy promise at 4 bits where plain coding does not
(docs/accuracy.md), so ``auto``, the default, turns it on wherever the job can have it, and steps
aside, with a warning that says why, where it cannot:

* policies other than ``consecutive`` and methods that do not quantize (decided by the config);
* an optimizer that keeps state per column (EXACT_ADAGRAD): a residual delta would have to code
  that state too, and it stores it whole;
* hosts without the memory for the float32 copy of their ranks' shards beside what a baseline
  stages to host memory (and, with compaction, the fold's largest shard on top), with 10% headroom.

``true`` refuses each of these with a ConfigError instead, and ``false`` keeps plain coding. The
config decides the first case itself (:attr:`~cnr_torchrec.ckpt.config.CheckpointConfig.residual_from_config`);
this module the others, for :func:`~cnr_torchrec.ckpt.config_resolve.resolve`, when the Checkpointer is
built, before anything is opened. The choice is the same on every rank: the optimizer check and the
memory check are collective.
"""

from __future__ import annotations

import logging

from cnr_torchrec.ckpt._collective import Ranks
from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.ckpt.host_memory import (
    check_host_memory,
    fold_bytes,
    reconstruction_bytes,
    shard_states,
    staging_bytes,
)
from cnr_torchrec.ckpt.save.staging import is_rowwise
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["choose_residual", "per_column_state_tables"]

log = logging.getLogger(__name__)


def per_column_state_tables(tracker: DirtyRowTracker) -> list[str]:
    """This rank's tables whose fused optimizer keeps state per column (one value per weight), sorted."""
    return sorted({table for table, shard, states in shard_states(tracker)
                   if not all(is_rowwise(s, shard.num_rows) for s in states)})


HEADROOM = 1.1
"""What residual coding budgets, over the bytes it counts: allocator slack, decode temporaries, the bytes a
restore reads."""


def _memory(tracker: DirtyRowTracker, distributed: bool, compaction: bool, image: bool) -> None:
    """Logs the host memory residual coding keeps; ConfigError, on every rank, where a host does not have it.

    Besides the copy itself (which a restore stages into, and a baseline replaces as it writes), the job will
    hold a baseline's copy of its shards to host memory (any job does, but not yet when the Checkpointer is
    built) and, with compaction, a fold's working set: a host must have room for all of it, with headroom.
    """
    copy = reconstruction_bytes(tracker)
    if image:  # the memory tier keeps the copy as its image, with the optimizer states beside it
        copy += sum(t.numel() * t.element_size() for _, _, states in shard_states(tracker) for t in states)
    staging = staging_bytes(tracker)
    fold = fold_bytes(tracker) if compaction else 0
    kept = " (the memory tier's image, with the optimizer states)" if image else ""
    what = (f"a float32 copy of each rank's shards{kept}, beside what a baseline copies to host memory"
            + (", and while compaction folds the chain its largest shard's float32 sums and state and the 8-bit "
               "folded rows" if fold else "") + f", with {HEADROOM - 1:.0%} headroom")
    use = check_host_memory(round((copy + staging + fold) * HEADROOM), distributed=distributed, what=what)
    available = "unknown" if use.available is None else f"{use.available / 1e6:,.0f} MB"
    more = f", and {fold / 1e6:,.1f} MB more while a compaction folds the chain" if fold else ""
    log.info("quantization.residual keeps a float32 copy of this rank's shards: %s MB of host memory%s, beside a "
             "baseline's %s MB staged to host (host %s: %s MB with headroom for its %d rank(s), %s available)",
             f"{copy / 1e6:,.1f}", more, f"{staging / 1e6:,.1f}", use.host, f"{use.needed / 1e6:,.1f}", use.ranks,
             available)


def choose_residual(config: CheckpointConfig, tracker: DirtyRowTracker, ranks: Ranks) -> bool:
    """Whether this job codes residuals, for a ``config`` whose other defaults are settled. Collective
    unless ``config`` says ``residual: false``.

    Args:
        config: the config with ``compaction`` and ``quantization.bits`` as the job runs them (the memory check
            counts a fold's working set with compaction) and ``quantization.residual`` as the config decides it.
        tracker: this rank's shards and their optimizer state.
        ranks: every rank, which all call this at once.

    Returns:
        ``residual: true``'s or ``false``'s value; for ``auto``, whether every table keeps row-wise (or no)
        optimizer state and every host has the memory (a warning says why not).

    Raises:
        ConfigError: with ``residual: true``, on every rank, where a table keeps per-column optimizer
            state or a host lacks the memory.
    """
    wanted = config.quantization.residual
    if wanted is False:
        return False
    columns = sorted({t for tables in ranks.exchange(per_column_state_tables(tracker)) for t in tables})
    why = ""
    if columns:
        why = (f"table(s) {', '.join(columns)} keep optimizer state per column (such as EXACT_ADAGRAD's), which a "
               "residual delta does not code; use a row-wise optimizer (EXACT_ROWWISE_ADAGRAD) or none")
        if wanted is True:
            raise ConfigError(f"quantization.residual: true does not work here: {why}. Or set residual: false")
    else:
        try:
            _memory(tracker, ranks.distributed, config.compaction is not None, config.memory_tier.mode != "off")
        except ConfigError as e:
            if wanted is True:
                raise
            why = str(e)
    if why:
        log.warning("quantization.residual: auto steps aside, deltas are coded plainly: %s. Plain coding keeps "
                    "0.01%% of logloss at %s bits for fewer restores than residual coding does (docs/accuracy.md)",
                    why, config.quantization.bits)
    return not why
