"""Loads the compiled ``cnr_torchrec._C`` extension, which registers ``torch.ops.cnr``."""

import torch

try:
    from cnr_torchrec import _C  # noqa: F401  (importing registers the ops)
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "cnr_torchrec._C is not built. Run `make install` (or `pip install --no-build-isolation -e .`) "
        f"from the repository root first. Original error: {e}"
    ) from e

ops = torch.ops.cnr
