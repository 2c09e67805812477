"""The TorchRec stacks this package is tested on, and what it says about the one it finds.

The tracking hooks and the restore reach into FBGEMM's and TorchRec's internals (TBE attributes, sharded module
layouts, managed-collision buffers, optimizer state names), which change between releases, so a stack is
supported only once the suite has run on it. Each supported stack is one torch release line with the FBGEMM
line built for it and the TorchRec line released with that FBGEMM (:data:`TESTED`; docs/install.md has the
matrix and the install of each).

:func:`check` reads the installed distributions' metadata and torch's build, and finds:

* **an untested stack** (a torch, fbgemm or torchrec outside :data:`TESTED`, or a mix of two tested stacks):
  one warning, at ``import cnr_torchrec``, naming what it found and what is tested;
* **a mixed build**: fbgemm-gpu installed beside fbgemm-gpu-cpu (two builds of one module, whose files overwrote
  each other), a CPU-only torch under fbgemm-gpu, or fbgemm-gpu-cpu under a CUDA torch on a machine with a GPU
  (then no TBE can run on it). Each is named with its fix; :func:`refuse_mixed_build` (``CheckNRunDMP``) raises
  for the first two, and for the third when the model is placed on a CUDA device.

``CNR_ALLOW_UNTESTED_STACK=1`` silences the warning and lifts the refusals, for a user who wants to try.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import warnings
from dataclasses import dataclass

from cnr_torchrec.errors import UnsupportedStackError

__all__ = ["ALLOW_ENV", "TESTED", "Found", "Stack", "check", "found", "refuse_mixed_build", "warn_once"]

ALLOW_ENV = "CNR_ALLOW_UNTESTED_STACK"


@dataclass(frozen=True)
class Stack:
    """One tested stack: the release lines (major.minor) of torch, FBGEMM and TorchRec, and the pins its suite ran."""

    name: str
    torch: str
    fbgemm: str
    torchrec: str
    pins: str  # as a user installs it

    def holds(self, torch: str, fbgemm: str, torchrec: str) -> bool:
        return (_line(torch), _line(fbgemm), _line(torchrec)) == (self.torch, self.fbgemm, self.torchrec)


# Newest first (stacks/*.env pins the exact releases; the repository's own venv takes 1.8, the lighter).
TESTED: tuple[Stack, ...] = (
    Stack("1.9", torch="2.14", fbgemm="1.9", torchrec="1.9",
          pins="torch==2.14.1 fbgemm-gpu-cpu==1.9.0 torchrec==1.9.2 (fbgemm-gpu==1.9.0 on CUDA)"),
    Stack("1.8", torch="2.13", fbgemm="1.8", torchrec="1.8",
          pins="torch==2.13.0 fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 (fbgemm-gpu==1.8.0 on CUDA)"),
)


@dataclass(frozen=True)
class Found:
    """What is installed: versions (None: not installed), which fbgemm distributions, and torch's build."""

    torch: str | None
    torchrec: str | None
    fbgemm_gpu: str | None  # the CUDA build's distribution
    fbgemm_gpu_cpu: str | None
    torch_cuda: bool  # torch is a CUDA build
    gpu: bool  # and sees a GPU

    @property
    def fbgemm(self) -> str | None:
        return self.fbgemm_gpu or self.fbgemm_gpu_cpu

    def describe(self) -> str:
        fb = " + ".join(f"{n} {v}" for n, v in (("fbgemm-gpu", self.fbgemm_gpu), ("fbgemm-gpu-cpu",
                                                                                   self.fbgemm_gpu_cpu)) if v)
        build = "CUDA" if self.torch_cuda else "CPU"
        return f"torch {self.torch} ({build} build), {fb or 'no fbgemm'}, torchrec {self.torchrec}"


def _line(version: str | None) -> str:
    """``2.14.1+cu130`` -> ``2.14``."""
    if not version:
        return ""
    return ".".join(version.split("+")[0].split(".")[:2])


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def found() -> Found:
    """The installed stack, from the distributions' metadata and torch's build."""
    import torch

    cuda = torch.version.cuda is not None
    return Found(torch=_version("torch"), torchrec=_version("torchrec"), fbgemm_gpu=_version("fbgemm-gpu"),
                 fbgemm_gpu_cpu=_version("fbgemm-gpu-cpu"), torch_cuda=cuda,
                 gpu=cuda and torch.cuda.is_available())


def _tested() -> str:
    return "; ".join(f"{s.name}: {s.pins}" for s in TESTED)


def untested(f: Found) -> str | None:
    """Why ``f`` is outside the tested stacks, or None."""
    if f.torch and f.fbgemm and f.torchrec and any(s.holds(f.torch, f.fbgemm, f.torchrec) for s in TESTED):
        return None
    return (f"cnr_torchrec is tested on {_tested()}; this environment has {f.describe()}. Install one tested stack "
            f"(docs/install.md), or set {ALLOW_ENV}=1 to go on untested.")


def mixed(f: Found, *, cuda_model: bool = False) -> str | None:
    """A mixed build in ``f`` and its fix, or None. ``cuda_model``: the model goes onto a CUDA device."""
    if f.fbgemm_gpu and f.fbgemm_gpu_cpu:
        return (f"fbgemm-gpu {f.fbgemm_gpu} and fbgemm-gpu-cpu {f.fbgemm_gpu_cpu} are both installed: two builds of "
                "the one module fbgemm_gpu, whose files overwrote each other. Uninstall both and install one: "
                "fbgemm-gpu beside a CUDA torch, fbgemm-gpu-cpu beside a CPU one (install torchrec with --no-deps, "
                "since it declares fbgemm-gpu).")
    if f.fbgemm_gpu and not f.torch_cuda:
        return (f"fbgemm-gpu {f.fbgemm_gpu} (a CUDA build) is installed beside a CPU build of torch {f.torch}: it "
                f"does not load. Install fbgemm-gpu-cpu=={f.fbgemm_gpu} in its place, or a CUDA torch.")
    if f.fbgemm_gpu_cpu and f.torch_cuda and (f.gpu or cuda_model):
        return (f"fbgemm-gpu-cpu {f.fbgemm_gpu_cpu} is installed beside a CUDA torch {f.torch} on a machine with a "
                "GPU, or a model going onto one: its tables run on the CPU only, and a model on a CUDA device fails at "
                "its first lookup. Install "
                f"fbgemm-gpu=={f.fbgemm_gpu_cpu} in its place (after uninstalling fbgemm-gpu-cpu).")
    return None


def _allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "0") not in ("", "0")


_warned = False


def warn_once() -> None:
    """At import: one warning for an untested stack or a mixed build (none under ``CNR_ALLOW_UNTESTED_STACK=1``)."""
    global _warned
    if _warned or _allowed():
        return
    _warned = True
    f = found()
    for why in (mixed(f), untested(f)):
        if why:
            warnings.warn(why, UserWarning, stacklevel=3)


def refuse_mixed_build(*, cuda_model: bool) -> None:
    """Raises before a model is sharded on a mixed build (see :func:`mixed`), unless ``CNR_ALLOW_UNTESTED_STACK=1``.

    Raises:
        UnsupportedStackError: the message names the distributions found and the fix.
    """
    if _allowed():
        return
    why = mixed(found(), cuda_model=cuda_model)
    if why:
        raise UnsupportedStackError(f"{why} ({ALLOW_ENV}=1 goes on anyway.)")


def check() -> tuple[str | None, str | None]:
    """(mixed build, untested stack): the two findings for this environment, each None when all is well."""
    f = found()
    return mixed(f), untested(f)
