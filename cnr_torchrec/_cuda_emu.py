"""Loads ``cnr_torchrec._C_cuda_emu``: our CUDA kernels run on the CPU under an emulation of CUDA.

The extension compiles ``csrc/cuda/*.cu`` and their bindings as host C++ against
``csrc/cuda_emu/`` and registers them as ``torch.ops.cnr_emu``, with the schemas of
``torch.ops.cnr``; tests compare the two on CPU tensors. It is built only with
``CNR_CUDA_EMU=1`` or ``CNR_CUDA_EMU=only`` (``make test`` builds it so).
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["load"]


def load() -> torch._ops._OpNamespace:
    """Registers the emulated CUDA ops and returns ``torch.ops.cnr_emu``.

    Environment: ``CNR_CUDA_EMU_SEED`` (an integer, read at every launch) picks the
    order in which the emulation runs threads and blocks.

    Returns:
        The ``cnr_emu`` op namespace: every op of ``torch.ops.cnr`` that has a CUDA
        kernel, plus ``host_reads()``, the device-to-host reads made so far.

    Raises:
        ImportError: the extension was not built.
    """
    try:
        importlib.import_module("cnr_torchrec._C_cuda_emu")  # compiled: importing it registers the ops
    except ImportError as e:
        raise ImportError(
            "cnr_torchrec._C_cuda_emu (the CUDA kernels under emulation, for tests) is not built. `make test` "
            "builds it; alone: `CNR_CUDA_EMU=only python setup.py build_ext --inplace` from the repository root. "
            f"Original error: {e}"
        ) from e
    return torch.ops.cnr_emu
