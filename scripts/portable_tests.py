"""The tests that ``make cuda-check`` runs against the portable build, in one place.

The portable build (``CNR_PORTABLE=1``: no x86 intrinsics, no ``-march``) is the CPU
extension alone, without the emulated CUDA kernels, so the emulated half of the
``backend`` fixture is deselected. ``scripts/install_check.sh`` runs this selection against
that build; ``tests/test_install.py`` sets it up (``--setup-only``) against a copy of the
package without the emulation, so that ``make test`` fails where that step would.

Usage, from a folder that holds ``tests/`` and ``pyproject.toml``:
    python portable_tests.py [pytest args...]
"""

from __future__ import annotations

import sys

import pytest

FILES = ["tests/test_codecs.py", "tests/test_tracking_ops.py", "tests/test_row_crc32c.py"]
# Parameter ids of the ``backend`` fixture (tests/conftest.py) that need cnr_torchrec._C_cuda_emu.
NEEDS_EMULATION = "cuda_emulated"


def main(argv: list[str]) -> int:
    return int(pytest.main(["-q", *FILES, "-k", f"not {NEEDS_EMULATION}", *argv]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
