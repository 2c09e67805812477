"""Differential, quantized checkpoints of a CheckNRunDMP (Check-N-Run), on torchsnapshot's storage plugins."""

from cnr_torchrec.ckpt.checkpointer import Checkpointer, CheckpointInfo, SaveHandle
from cnr_torchrec.ckpt.config import POLICIES, CheckpointConfig, QuantizationConfig, load_config

__all__ = [
    "POLICIES",
    "Checkpointer",
    "CheckpointConfig",
    "CheckpointInfo",
    "QuantizationConfig",
    "SaveHandle",
    "load_config",
]
