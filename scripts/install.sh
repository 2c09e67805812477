#!/usr/bin/env bash
# Creates (or refreshes) the project virtualenv with the pinned stack.
# Usage: [STACK=1.8] scripts/install.sh VENV_DIR [REQUIREMENTS]
#   STACK: which stacks/STACK.env pins torch, fbgemm and torchrec (1.8, the default, or 1.9).
#   REQUIREMENTS: requirements.txt (the default: the library, the example job and the build)
#   or requirements-test.txt (those and the tests' own).
#
# Quiet by design: pip prints errors only (this machine's pip configuration names package
# indexes that do not exist, one warning per package). pip writes no bytecode: a venv of
# torch and its kin is 7,000 files of which a job imports 2,000; importing those once at the
# end writes theirs.
set -euo pipefail
venv=${1:-.venv}
requirements=${2:-requirements.txt}
python=${PYTHON:-python3}
stack_file="$(dirname "$0")/../stacks/${STACK:-1.8}.env"
[ -f "$stack_file" ] || { echo "no stack ${STACK:-1.8}: stacks/ has $(ls "$(dirname "$0")/../stacks")" >&2; exit 2; }
# shellcheck source=/dev/null
. "$stack_file"  # TORCH, FBGEMM, TORCHREC

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -qq "$@"; }

# torch first, pinned: an unpinned torch requirement elsewhere would pull CUDA wheels.
pip install --no-compile "torch==$TORCH"
# Which build it is, read from torch/version.py alone: importing torch now would warn that
# numpy is missing, and compile half of torch.
if "$venv/bin/python" - <<'EOF'
import importlib.util, os, sys
torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
spec = importlib.util.spec_from_file_location("torch_build", os.path.join(torch_dir, "version.py"))
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
sys.exit(0 if build.cuda else 1)
EOF
then
  # A CUDA torch: fbgemm-gpu where a GPU driver is, else the CPU build (PyPI's torch 2.14 is only the CUDA
  # build, which runs on a CPU machine; fbgemm-gpu's CUDA build would not load there without a driver).
  if [ -e /proc/driver/nvidia/version ]; then
    pip install --no-compile "fbgemm-gpu==$FBGEMM"
  else
    pip install --no-compile "fbgemm-gpu-cpu==$FBGEMM"
  fi
else
  pip install --no-compile "fbgemm-gpu-cpu==$FBGEMM"
fi
pip install --no-compile -r "$requirements"
# Last and without its dependencies: torchrec declares the CUDA build `fbgemm-gpu`, which a CPU
# environment must not get (requirements-torchrec.txt names the rest, installed above). Installed
# last, pip has nothing of torchrec's left to check, so it prints no resolver complaint.
pip install --no-compile --no-deps "torchrec==$TORCHREC"

# Bytecode for what the jobs and the tests import, written once, here. Python would write it at
# the first import, but not where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines): there every process, each rank of each job, would compile its ~2,000 modules of
# torch and TorchRec again (about 14 s each on 2 cores).
imports="torchrec torchsnapshot torchdata.stateful_dataloader"
if [ "$(basename "$requirements")" = requirements-test.txt ]; then
  imports="$imports pytest moto boto3 aiobotocore matplotlib.pyplot google_crc32c"
fi
env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -W ignore - $imports <<'EOF'
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
EOF
