#!/usr/bin/env bash
# Creates (or refreshes) the project virtualenv with the pinned stack.
# Usage: scripts/install.sh VENV_DIR
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# torch first, pinned: an unpinned torch requirement elsewhere would pull CUDA wheels.
pip install torch==2.13.0
if "$venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; then
  pip install fbgemm-gpu==1.8.0
else
  pip install fbgemm-gpu-cpu==1.8.0
fi
# torchrec declares the CUDA fbgemm-gpu package; install it bare and pin its deps ourselves.
pip install --no-deps torchrec==1.8.0
pip install -r requirements.txt
