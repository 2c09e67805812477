"""cnr_torchrec: Check-N-Run / CPR differential, quantized checkpoints for TorchRec."""

from cnr_torchrec import ops  # noqa: F401  (registers torch.ops.cnr)
from cnr_torchrec.dmp import CheckNRunDMP
from cnr_torchrec.errors import (
    CnrError,
    RowIdOutOfRangeError,
    TrackingNotEnabledError,
    UnknownTableError,
    UnsupportedShardingError,
)
from cnr_torchrec.track import DirtyRowTracker

__all__ = [
    "CheckNRunDMP",
    "DirtyRowTracker",
    "CnrError",
    "RowIdOutOfRangeError",
    "TrackingNotEnabledError",
    "UnknownTableError",
    "UnsupportedShardingError",
]
