"""Builds the ``cnr_torchrec._C`` extension.

CPU kernels are always built. CUDA kernels (``csrc/cuda/*.cu`` plus their
``*_bind.cpp`` bindings) are added only when torch itself is a CUDA build, a
CUDA toolkit is found, and FBGEMM is its CUDA build (``fbgemm-gpu``): a CPU build
of torch cannot build CUDAExtension, and beside ``fbgemm-gpu-cpu`` (which a CUDA
torch on a CPU machine takes, PyPI's torch 2.14 being the CUDA build only) no
table ever runs on a GPU, so the kernels would cost 4 minutes of build for nothing.

A machine with the toolkit and no GPU builds them too. Without ``CUDA_HOME``, the
toolkit is the first candidate root that holds its headers: torch's own guess, the
folder above the first ``nvcc`` on the PATH, is wrong when that ``nvcc`` is a
wrapper script. Without ``TORCH_CUDA_ARCH_LIST``, which torch would read from the
absent GPU, the kernels are built for sm_80 and sm_90.
"""

import glob
import importlib.metadata
import os
import platform
import shutil

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0"
# The extension shares the process's libstdc++ with torch, even under a compiler that links it
# statically by default: a private copy breaks every C++ exception that crosses into torch (on one
# GPU machine's toolchain, each error raised by an op killed the process; docs/gpu.md). Linked
# ahead of the compiler's own libraries, the shared libstdc++ resolves every C++ runtime symbol.
SHARED_LIBSTDCXX_FLAGS = ["-Wl,--push-state,--no-as-needed", "-lstdc++", "-Wl,--pop-state"]
# torch 2.14's headers need C++20 (std::strong_ordering in c10/util/intrusive_ptr.h, requires-clauses in
# ATen/core/TensorBase.h); 2.13's compile under it as well, so every host C++ unit is built with it. The .cu
# files include no torch header and keep C++17, which every supported nvcc accepts.
CXX_STD = "-std=c++20"


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

try:
    import torch  # noqa: E402
except ImportError as e:
    # pyproject.toml names no torch to build with: under pip's build isolation this is where it stops.
    raise SystemExit(
        "cnr_torchrec compiles against the torch of the environment it goes into. Install torch, "
        "fbgemm-gpu (or fbgemm-gpu-cpu) and torchrec first, then run "
        "`pip install --no-build-isolation .` (pip's isolated build environment has no torch; one "
        "fetched for it could differ from yours in version or CUDA build, and the extension would "
        "not load)."
    ) from e
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

if torch.version.cuda is not None and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _debug_info() -> list[str]:
    """No debug info unless ``CNR_DEBUG_INFO=1``: Python's own flags ask for ``-g``, which
    makes the compiler write several times more and the build slower, for symbols that
    only a debugger reads."""
    return [] if os.environ.get("CNR_DEBUG_INFO", "0") == "1" else ["-g0"]


def _cxx_flags() -> list[str]:
    """Host compiler flags of ``cnr_torchrec._C``.

    x86-64 builds target x86-64-v2 (SSE4.2, POPCNT; the AVX2 and AVX-512 kernels are
    picked at run time). ``CNR_PORTABLE=1`` builds the generic-vector code that other
    CPUs run, with no x86 intrinsics and no ``-march``, so that path is tested on x86.
    """
    flags = ["-O3", CXX_STD, "-fopenmp", "-DNDEBUG", *_debug_info()]
    if os.environ.get("CNR_PORTABLE", "0") == "1":
        flags.append("-DCNR_NO_X86_INTRINSICS")
    elif platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=x86-64-v2")
    return flags


def _shared_libstdcxx() -> list[str]:
    return SHARED_LIBSTDCXX_FLAGS if platform.system() == "Linux" else []


def _headers() -> list[str]:
    """Every header under csrc/: a change to one rebuilds the extensions."""
    return _sources("csrc/*.h") + _sources("csrc/*/*.h") + _sources("csrc/*/*.cuh")


def _cuda_fbgemm() -> bool:
    """Whether the installed FBGEMM is the CUDA build: fbgemm-gpu, or no FBGEMM yet (a build ahead of it)."""
    def installed(dist: str) -> bool:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return False
        return True

    return installed("fbgemm-gpu") or not installed("fbgemm-gpu-cpu")


def _extension():
    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    cxx_flags = _cxx_flags()
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and _cuda_fbgemm()
    if os.environ.get("CNR_FORCE_CPU", "0") == "1":
        with_cuda = False
    if with_cuda:
        sources += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*_bind.cpp")
        return CUDAExtension(
            "cnr_torchrec._C",
            sources,
            depends=_headers(),
            extra_compile_args={"cxx": cxx_flags + ["-DCNR_WITH_CUDA"], "nvcc": ["-O3", "-std=c++17"]},
            extra_link_args=["-fopenmp", *_shared_libstdcxx()],
        )
    return CppExtension("cnr_torchrec._C", sources, depends=_headers(), extra_compile_args=cxx_flags,
                        extra_link_args=["-fopenmp", *_shared_libstdcxx()])


def _emulated_cuda_extension():
    """``cnr_torchrec._C_cuda_emu``: the CUDA kernels of csrc/cuda/ run on the CPU, for tests.

    The same ``.cu`` and ``*_bind.cpp`` sources as the CUDA build, compiled as host
    C++ against the emulated CUDA runtime of csrc/cuda_emu/ (whose shim headers come
    first on the include path), register ``torch.ops.cnr_emu``. Built only with
    ``CNR_CUDA_EMU=1`` (beside ``_C``) or ``CNR_CUDA_EMU=only`` (alone; ``make test``
    builds it so). No FMA contraction: the kernels' ``_rn`` arithmetic must round like
    the GPU's.
    """
    flags = ["-O2", CXX_STD, "-ffp-contract=off", "-fvisibility=hidden", "-DCNR_CUDA_EMU", *_debug_info()]
    return CppExtension(
        "cnr_torchrec._C_cuda_emu",
        _sources("csrc/cuda_emu/*.cpp"),
        depends=_headers() + _sources("csrc/cuda/*"),
        include_dirs=[os.path.join(ROOT, "csrc", "cuda_emu")],
        extra_compile_args=flags,
        extra_link_args=_shared_libstdcxx(),
    )


def _ext_modules() -> list:
    """``_C``, plus the emulated CUDA kernels under ``CNR_CUDA_EMU=1``, or those alone under
    ``CNR_CUDA_EMU=only``."""
    emu = os.environ.get("CNR_CUDA_EMU", "0")
    if emu not in ("0", "1", "only"):
        raise SystemExit(f"CNR_CUDA_EMU={emu!r}: use 0 (the default), 1 (with _C) or only (without _C).")
    return ([] if emu == "only" else [_extension()]) + ([] if emu == "0" else [_emulated_cuda_extension()])


# The package's metadata, dependencies and entry points are in pyproject.toml.
setup(
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
