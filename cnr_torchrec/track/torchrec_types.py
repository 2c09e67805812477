"""How the tracker types the TorchRec and FBGEMM modules it reads."""

from __future__ import annotations

from typing import Any

__all__ = ["TorchRecModule"]

TorchRecModule = Any
"""A TorchRec or FBGEMM module whose attributes (a DMP's ``plan``, a lookup kernel's ``config``, a TBE's buffers
and methods) are read by name. Typed Any: nn.Module's ``__getattr__`` types each of them ``Tensor | Module``."""
