"""Compaction: a chain folded into one baseline that restores what the chain restores.

* :mod:`~cnr_torchrec.ckpt.compact.merge`: the lossless merge core. Each row keeps the
  stored bytes of the newest checkpoint that holds it.
* :mod:`~cnr_torchrec.ckpt.compact.background`: the training job's compactor. The ranks
  merge in the background and commit like a save; the next delta then hangs on the result.
* :mod:`~cnr_torchrec.ckpt.compact.offline`: ``cnr compact``, one process over a root,
  lossless or re-encoded with a codec.
"""
