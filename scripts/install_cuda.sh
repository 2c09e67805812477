#!/usr/bin/env bash
# Creates (or refreshes) a second virtualenv with the CUDA builds of the pinned stack, for
# `make cuda-check` on a machine that has the CUDA toolkit (a GPU is not needed).
# Usage: [STACK=1.8] scripts/install_cuda.sh VENV_DIR   (stacks/STACK.env pins the releases)
set -euo pipefail
venv=${1:-.venv-cuda}
python=${PYTHON:-python3}
# shellcheck source=/dev/null
. "$(dirname "$0")/../stacks/${STACK:-1.8}.env"  # TORCH, FBGEMM, TORCHREC

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# --isolated: this machine's pip configuration prefers a local CPU-only torch wheel; the CUDA
# builds (torch +cu130 and its nvidia-* packages, about 7 GB) come from the registry.
pip() { "$venv/bin/python" -m pip --isolated --disable-pip-version-check -q "$@"; }

pip install "torch==$TORCH" "fbgemm-gpu==$FBGEMM"
"$venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else "torch is not a CUDA build")'
# The tests run against this venv: their requirements too. torchrec last and bare, as in
# scripts/install.sh.
pip install -r requirements-test.txt
pip install --no-deps "torchrec==$TORCHREC"
# fbgemm-gpu's CUDA build needs the driver's NVML to import; without a GPU, a stub answers
# "driver not loaded" (see scripts/nvml_stub.c). It lives in the venv and is found through
# LD_LIBRARY_PATH in `make cuda-check` only.
cc -shared -fPIC -O2 -o "$venv/lib/libnvidia-ml.so.1" scripts/nvml_stub.c
