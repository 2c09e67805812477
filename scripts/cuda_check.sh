#!/usr/bin/env bash
# `make cuda-check`: builds the whole extension (CPU kernels, the .cu files and their bind
# files) against the CUDA build of torch in VENV, checks that every op the training, save
# and restore paths use has a CUDA kernel, then runs the CPU test suite against that build,
# with the emulated CUDA kernels (CNR_CUDA_EMU=1, the default) so that the emulation tests
# run too.
# First, scripts/install_check.sh installs the package as a user would (wheels built with
# --no-build-isolation) into this venv and into the CPU venv (CPU_VENV, default .venv),
# with the portable no-intrinsics build. The builds happen in copies of the tree (BUILD_DIR,
# temporary folders), so the CPU build in place and the venvs' installs are untouched.
# Usage: [CPU_VENV=.venv] scripts/cuda_check.sh VENV BUILD_DIR [pytest args...]
set -euo pipefail
venv=$(cd "$1" && pwd)
cpu_venv=$(cd "${CPU_VENV:-.venv}" && pwd)
build=$2
shift 2
root=$(pwd)

rm -rf "$build"
mkdir -p "$build"
# Tracked and untracked (not ignored) files, as they are in the working tree.
git ls-files -z --cached --others --exclude-standard | tar --null -T - -c | tar -x -C "$build"
cd "$build"
# The NVML stub stands in for the driver only where there is none: on a GPU machine it would
# hide the driver's NVML from fbgemm-gpu and NCCL.
if ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml\.so\.1'; then
  echo "cuda-check: the driver's NVML is installed; the stub in $venv/lib stays unused"
else
  export LD_LIBRARY_PATH="$venv/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
start=$(date +%s)
# While the copy is still clean: install_check.sh copies it again for each of its builds.
bash scripts/install_check.sh . "$cpu_venv" "$venv"
installs=$(( $(date +%s) - start ))
step=$(date +%s)
CNR_CUDA_EMU=${CNR_CUDA_EMU:-1} MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" -m pip --isolated --disable-pip-version-check -q install \
  --no-build-isolation --no-deps -e .
built=$(( $(date +%s) - step ))
echo "cuda-check: extension built in $built s"
"$venv/bin/python" scripts/cuda_ops.py
step=$(date +%s)
"$venv/bin/python" -m pytest "$@"
echo "cuda-check: install checks $installs s, build $built s, tests $(( $(date +%s) - step )) s"
echo "cuda-check: done in $(( $(date +%s) - start )) s (tree copied from $root)"
