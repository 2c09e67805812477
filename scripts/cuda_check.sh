#!/usr/bin/env bash
# `make cuda-check`: builds the whole extension (CPU kernels, the .cu files and their bind
# files) against the CUDA build of torch in VENV, checks that every op the training, save
# and restore paths use has a CUDA kernel, then runs the CPU test suite against that build.
# The build happens in a copy of the tree (BUILD_DIR), so the CPU build in place is untouched.
# Usage: scripts/cuda_check.sh VENV BUILD_DIR [pytest args...]
set -euo pipefail
venv=$(cd "$1" && pwd)
build=$2
shift 2
root=$(pwd)

rm -rf "$build"
mkdir -p "$build"
# Tracked and untracked (not ignored) files, as they are in the working tree.
git ls-files -z --cached --others --exclude-standard | tar --null -T - -c | tar -x -C "$build"
cd "$build"
export LD_LIBRARY_PATH="$venv/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" -m pip --isolated --disable-pip-version-check -q install \
  --no-build-isolation --no-deps -e .
echo "cuda-check: extension built in $(( $(date +%s) - start )) s"
"$venv/bin/python" scripts/cuda_ops.py
"$venv/bin/python" -m pytest "$@"
echo "cuda-check: done in $(( $(date +%s) - start )) s (tree copied from $root)"
