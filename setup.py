"""Builds the ``cnr_torchrec._C`` extension.

CPU kernels are always built. CUDA kernels (``csrc/cuda/*.cu`` plus their
``*_bind.cpp`` bindings) are added only when torch itself is a CUDA build and a
CUDA toolkit is found, because a CPU build of torch cannot build CUDAExtension.

A machine with the toolkit and no GPU builds them too. Without ``CUDA_HOME``, the
toolkit is the first candidate root that holds its headers: torch's own guess, the
folder above the first ``nvcc`` on the PATH, is wrong when that ``nvcc`` is a
wrapper script. Without ``TORCH_CUDA_ARCH_LIST``, which torch would read from the
absent GPU, the kernels are built for sm_80 and sm_90.
"""

import glob
import os
import shutil

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def _find_cuda_home() -> str | None:
    """The first CUDA toolkit root that has ``include/cuda_runtime.h``."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_PATH")]
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


# Both are read by torch.utils.cpp_extension at import, so they are settled before it.
if not os.environ.get("CUDA_HOME"):
    found = _find_cuda_home()
    if found:
        os.environ["CUDA_HOME"] = found

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

if torch.version.cuda is not None and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extension():
    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-march=x86-64-v2", "-DNDEBUG"]
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if os.environ.get("CNR_FORCE_CPU", "0") == "1":
        with_cuda = False
    if with_cuda:
        sources += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*_bind.cpp")
        return CUDAExtension(
            "cnr_torchrec._C",
            sources,
            extra_compile_args={"cxx": cxx_flags + ["-DCNR_WITH_CUDA"], "nvcc": ["-O3", "-std=c++17"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension("cnr_torchrec._C", sources, extra_compile_args=cxx_flags, extra_link_args=["-fopenmp"])


setup(
    name="cnr_torchrec",
    version="0.1.0",
    description="Check-N-Run / CPR differential, quantized checkpoints for TorchRec",
    packages=find_packages(include=["cnr_torchrec", "cnr_torchrec.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["cnr = cnr_torchrec.cli:main"]},
    python_requires=">=3.10",
)
