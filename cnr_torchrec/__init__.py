"""cnr_torchrec: Check-N-Run / CPR differential, quantized checkpoints for TorchRec."""

from cnr_torchrec import ops  # noqa: F401  (registers torch.ops.cnr)
from cnr_torchrec.ckpt import (
    Checkpointer,
    CheckpointConfig,
    CheckpointInfo,
    QuantizationConfig,
    SaveHandle,
    load_config,
)
from cnr_torchrec.dmp import CheckNRunDMP
from cnr_torchrec.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointerClosedError,
    CnrError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    RestoreFailedError,
    SaveFailedError,
    StorageError,
    UnsafeCheckpointError,
    MalformedLookupError,
    RowIdOutOfRangeError,
    TrackingNotEnabledError,
    UnknownTableError,
    UnsupportedShardingError,
)
from cnr_torchrec.track import DirtyRowTracker

__all__ = [
    "CheckNRunDMP",
    "Checkpointer",
    "CheckpointConfig",
    "CheckpointInfo",
    "QuantizationConfig",
    "SaveHandle",
    "load_config",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointerClosedError",
    "ConfigError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "RestoreFailedError",
    "SaveFailedError",
    "StorageError",
    "UnsafeCheckpointError",
    "DirtyRowTracker",
    "CnrError",
    "RowIdOutOfRangeError",
    "MalformedLookupError",
    "TrackingNotEnabledError",
    "UnknownTableError",
    "UnsupportedShardingError",
]
