"""Builds the ``cnr_torchrec._C`` extension.

CPU kernels are always built. CUDA kernels (``csrc/cuda/*.cu`` plus their
``*_bind.cpp`` bindings) are added only when torch itself is a CUDA build and a
CUDA toolkit is found, because a CPU build of torch cannot build CUDAExtension.
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


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
