"""The config a Checkpointer runs with: the defaults a :class:`~cnr_torchrec.ckpt.config.CheckpointConfig`
leaves to the job, settled once.

A config is what its author wrote, checked and never rewritten. :func:`resolve` settles what it leaves
open, in this order, each step seeing the ones before:

1. ``quantization.bits`` left out: :data:`~cnr_torchrec.ckpt.config.DEFAULT_BITS` for a method that offers it;
2. ``compaction`` left at :data:`~cnr_torchrec.ckpt.config.DEFAULT_COMPACTION`: kept under policy
   ``consecutive`` without a row budget, none otherwise;
3. ``quantization.residual: auto``: plain coding where the policy or the method leaves residual coding
   nothing to do (the config decides), else decided for the job by
   :func:`~cnr_torchrec.ckpt.residual_choice.choose_residual` (its optimizer state and host memory);
4. ``failure.bits_table`` left out: the measured table of that coding
   (:func:`~cnr_torchrec.ckpt.config.measured_bits_table`).

The result is a ``CheckpointConfig`` again, built by :func:`dataclasses.replace` and so checked like any:
the Checkpointer keeps it as ``Checkpointer.config``, hands it to its collaborators, and records its values
(the manifests' codec, the memory tier's identity).
"""

from __future__ import annotations

import dataclasses

from cnr_torchrec.ckpt._collective import Ranks
from cnr_torchrec.ckpt.config import DEFAULT_COMPACTION, CheckpointConfig, measured_bits_table
from cnr_torchrec.ckpt.residual_choice import choose_residual
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["resolve"]


def resolve(config: CheckpointConfig, tracker: DirtyRowTracker, ranks: Ranks) -> CheckpointConfig:
    """``config`` with every default that depends on the job settled, as the Checkpointer runs it. Collective
    where ``quantization.residual: auto`` is left to the job (every rank calls it at once, with the same config).

    Args:
        config: the config as given; it is left as it is.
        tracker: this rank's shards and their optimizer state.
        ranks: every rank.

    Returns:
        A new config: ``quantization.bits`` set where it was left out of a quantizing method, ``compaction``
        as it runs (None where the default does not fit), ``quantization.residual`` True or False, and
        ``failure.bits_table`` filled in.

    Raises:
        ConfigError: on every rank, where ``residual: true`` does not work for this job (per-column optimizer
            state, a host short of memory), or where a measured table does not fit ``failure.fallback_bits``.
    """
    q = config.quantization
    compaction = config.compaction
    if compaction is DEFAULT_COMPACTION and (config.policy != "consecutive"
                                             or config.budget.max_rows_fraction is not None):
        compaction = None  # the default is for the chains it fits, not a request
    settled = dataclasses.replace(
        config, compaction=compaction,
        quantization=dataclasses.replace(q, bits=q.bits_or_default, residual=config.residual_from_config))
    residual = choose_residual(settled, tracker, ranks)
    failure = settled.failure
    if failure.bits_table is None:
        failure = dataclasses.replace(failure, bits_table=measured_bits_table(residual))
    return dataclasses.replace(settled, failure=failure,
                               quantization=dataclasses.replace(settled.quantization, residual=residual))
