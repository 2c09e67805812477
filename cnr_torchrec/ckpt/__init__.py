"""Differential, quantized checkpoints of a CheckNRunDMP (Check-N-Run), on torchsnapshot's storage plugins."""

from cnr_torchrec.ckpt.checkpointer import Checkpointer, CheckpointInfo, SaveHandle
from cnr_torchrec.ckpt.config import (
    POLICIES,
    BudgetConfig,
    CheckpointConfig,
    CompactionConfig,
    FailureConfig,
    IntegrityConfig,
    KeepConfig,
    MemoryTierConfig,
    QuantizationConfig,
    load_config,
)

__all__ = [
    "POLICIES",
    "BudgetConfig",
    "Checkpointer",
    "CheckpointConfig",
    "CheckpointInfo",
    "CompactionConfig",
    "FailureConfig",
    "KeepConfig",
    "IntegrityConfig",
    "MemoryTierConfig",
    "QuantizationConfig",
    "SaveHandle",
    "load_config",
]
