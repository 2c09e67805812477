"""cnr_torchrec: Check-N-Run / CPR differential, quantized checkpoints for TorchRec."""

from cnr_torchrec import _stack

_stack.warn_once()  # before the extension loads: an untested or mixed stack is named first (_stack.py)

from cnr_torchrec import ops  # noqa: F401  (registers torch.ops.cnr)
from cnr_torchrec.ckpt import (
    BudgetConfig,
    CheckpointConfig,
    Checkpointer,
    CheckpointInfo,
    CompactionConfig,
    FailureConfig,
    IntegrityConfig,
    KeepConfig,
    MemoryTierConfig,
    QuantizationConfig,
    SaveHandle,
    load_config,
)
from cnr_torchrec.ckpt.warm_start import vocabulary_remap, warm_start
from cnr_torchrec.dmp import CheckNRunDMP
from cnr_torchrec.errors import (
    CheckpointerClosedError,
    CheckpointError,
    CheckpointNotFoundError,
    CnrError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    MalformedLookupError,
    RestoreFailedError,
    RowIdOutOfRangeError,
    SaveFailedError,
    StorageError,
    TrackingNotEnabledError,
    UnauthenticatedCheckpointError,
    UnknownTableError,
    UnsafeCheckpointError,
    UnsupportedShardingError,
    UnsupportedStackError,
)
from cnr_torchrec.track import DirtyRowTracker

__all__ = [
    "CheckNRunDMP",
    "warm_start",
    "vocabulary_remap",
    "Checkpointer",
    "CheckpointConfig",
    "CheckpointInfo",
    "QuantizationConfig",
    "BudgetConfig",
    "CompactionConfig",
    "FailureConfig",
    "KeepConfig",
    "IntegrityConfig",
    "MemoryTierConfig",
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
    "UnauthenticatedCheckpointError",
    "UnsafeCheckpointError",
    "DirtyRowTracker",
    "CnrError",
    "RowIdOutOfRangeError",
    "MalformedLookupError",
    "TrackingNotEnabledError",
    "UnknownTableError",
    "UnsupportedShardingError",
    "UnsupportedStackError",
]
