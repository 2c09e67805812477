"""The state of live objects, read for a save and written back by a restore: the model's dense parameters and
buffers, the dense optimizer, the random number generators. It sits on the format (``ckpt/format/``), which
knows nothing of models or optimizers."""
