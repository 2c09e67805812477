"""Loads the compiled ``cnr_torchrec._C`` extension, which registers ``torch.ops.cnr``."""

import importlib

import torch

try:
    importlib.import_module("cnr_torchrec._C")  # the compiled extension: importing it registers the ops
except ImportError as e:  # pragma: no cover - depends on the build
    # Not built, or built against another torch (an undefined symbol): either way, rebuild.
    raise ImportError(
        f"cnr_torchrec._C does not load with this torch ({torch.__version__}): it is not built, or it was "
        "built against another torch. In a checkout run `make install`; otherwise reinstall with "
        "`pip install --no-build-isolation --no-deps --force-reinstall <cnr_torchrec source>` in this "
        f"environment. Original error: {e}"
    ) from e

ops = torch.ops.cnr
