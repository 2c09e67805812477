"""How the extension is linked: with the process's shared libstdc++, as torch is.

A compiler that links libstdc++ statically by default gives the extension a private copy, and
then a C++ exception raised by an op crosses from one copy into torch's: on the GPU machine of
docs/gpu.md every such error killed the process. ``setup.py`` links the shared libstdc++ ahead
of the compiler's own libraries (``SHARED_LIBSTDCXX_FLAGS``); these tests check the built
extension, and that the flags win over ``-static-libstdc++``.
"""

from __future__ import annotations

import ast
import glob
import os
import platform
import shutil
import subprocess

import pytest

import cnr_torchrec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or shutil.which("readelf") is None,
                                reason="ELF and readelf only")


def _needed(path: str) -> list[str]:
    """The DT_NEEDED entries of a shared object."""
    out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def _setup_constant(name: str):
    """A module-level constant of setup.py, read without running setup()."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py defines no {name}")


def test_the_built_extensions_need_the_shared_libstdcxx():
    built = glob.glob(os.path.join(os.path.dirname(cnr_torchrec.__file__), "_C*.so"))
    assert built, "no built extension next to the package"
    for path in built:
        assert "libstdc++.so.6" in _needed(path), f"{os.path.basename(path)} carries its own libstdc++"


def test_the_link_flags_win_over_a_static_libstdcxx_default(tmp_path):
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler {cxx!r}")
    src = tmp_path / "throws.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void throws() { throw std::runtime_error("x"); }\n')

    def link(*flags: str) -> list[str]:
        out = tmp_path / "libthrows.so"
        subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(out), "-static-libstdc++", *flags],
                       check=True, capture_output=True)
        return _needed(str(out))

    assert "libstdc++.so.6" not in link(), "the compiler ignores -static-libstdc++: this test shows nothing"
    assert "libstdc++.so.6" in link(*_setup_constant("SHARED_LIBSTDCXX_FLAGS"))
