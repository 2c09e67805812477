"""Starting new training from a checkpoint: :func:`warm_start` (:mod:`.warm_start`)."""

from cnr_torchrec.transfer.warm_start import TableReport, WarmStartReport, vocabulary_remap, warm_start

__all__ = ["TableReport", "WarmStartReport", "vocabulary_remap", "warm_start"]
