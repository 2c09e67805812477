"""The on-storage format, shared by the save and restore sides: its records and the rules on them (manifests, the
schema, the one writer, commits, parts, placement, precedence, row ids), and under ``bytes/`` the bytes they
describe (storage and its plugins, integrity, payload blobs and chunks, rows). It knows nothing of models,
optimizers or TorchRec's modules: what reads and writes those is ``ckpt/live/``."""
