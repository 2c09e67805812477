#!/usr/bin/env bash
# Installs cnr_torchrec the way a user installs it into their own TorchRec environment, into
# the CPU venv and the CUDA venv, without changing either: each build is a wheel made with
# `pip wheel --no-build-isolation` from its own copy of SRC, installed with `--target` into
# a temporary folder and imported from outside the tree through PYTHONPATH.
#
# For each venv: `pip install --dry-run --no-index` of SRC with every extra proves that the
# venv already satisfies the declared dependencies (nothing to download, torch untouched);
# then the wheel is built, installed and checked (scripts/install_check.py imports; with the
# CUDA venv, scripts/cuda_ops.py). The CPU venv also builds the portable extension
# (CNR_PORTABLE=1: no x86 intrinsics, no -march), runs the CPU-kernel tests of
# scripts/portable_tests.py against it, and compares its codec digest with the default
# build's. Where Debian's aarch64 cross compiler is installed (g++-aarch64-linux-gnu), the
# CPU sources are also compiled for aarch64, a CPU with no x86 intrinsics; without it that
# step is skipped. Every step is timed.
#
# Usage: scripts/install_check.sh SRC CPU_VENV CUDA_VENV
#   SRC: a clean copy of the tree (no build outputs); it is not modified.
#   With CUDA_VENV's libraries found through LD_LIBRARY_PATH (its NVML stub), as in
#   scripts/cuda_check.sh, which calls this.
set -euo pipefail
src=$(cd "$1" && pwd)
cpu_venv=$(cd "$2" && pwd)
cuda_venv=$(cd "$3" && pwd)
work=$(mktemp -d /tmp/cnr-install-check.XXXXXX)
cd "$work"  # outside the tree: `import cnr_torchrec` finds only what PYTHONPATH names

timings=()
finish() {  # the times of the steps that ran, also when one failed
  echo "install-check: times"
  printf '  %s\n' "${timings[@]}"
  rm -rf "$work"
}
trap finish EXIT
step() {  # step NAME COMMAND...: runs COMMAND and records its wall time under NAME
  local name=$1 start=$SECONDS
  shift
  echo "install-check: $name"
  "$@"
  timings+=("$(printf '%5d s  %s' $((SECONDS - start)) "$name")")
}
pip_in() {  # pip_in VENV ARGS...: that venv's pip, ignoring this machine's pip configuration
  local venv=$1
  shift
  "$venv/bin/python" -m pip --isolated --disable-pip-version-check -q "$@"
}

# fresh_copy NAME: $work/src-NAME, a copy of SRC for one build (pip builds in the tree).
fresh_copy() {
  rm -rf "$work/src-$1"
  cp -a "$src" "$work/src-$1"
}
# deps_satisfied NAME VENV: nothing but cnr_torchrec itself would be installed from the
# copy NAME: the declared dependencies, the extras' included, are already in VENV, and
# --no-index would have failed on any that is not.
deps_satisfied() {
  local name=$1 venv=$2 report=$work/report-$1.json
  pip_in "$venv" install --dry-run --no-index --no-build-isolation --report "$report" "$work/src-$name[plot,s3,test]"
  "$venv/bin/python" - "$report" <<'EOF'
import json, sys
names = [i["metadata"]["name"] for i in json.load(open(sys.argv[1]))["install"]]
if names != ["cnr_torchrec"]:
    sys.exit(f"pip would install {names}, expected only cnr_torchrec")
print("  declared dependencies and extras are satisfied; pip would install only cnr_torchrec")
EOF
}

# build_and_install NAME VENV [ENV=VALUE...]: a wheel from the copy NAME, installed into
# $work/site-NAME.
build_and_install() {
  local name=$1 venv=$2
  shift 2
  step "$name: pip wheel --no-build-isolation" \
    env MAX_JOBS="${MAX_JOBS:-2}" "$@" "$venv/bin/python" -m pip --isolated --disable-pip-version-check -q \
    wheel --no-build-isolation --no-deps -w "$work/wheel-$name" "$work/src-$name"
  step "$name: pip install --target" \
    pip_in "$venv" install --no-deps --no-index --target "$work/site-$name" "$work"/wheel-"$name"/*.whl
}
run_in() {  # run_in NAME VENV COMMAND...: VENV's python importing the install NAME
  local name=$1 venv=$2
  shift 2
  PYTHONPATH="$work/site-$name" "$venv/bin/python" "$@"
}
# The portable build must hold no AVX code: its kernels are the generic 4-lane vectors
# that plain x86-64 compiles to SSE, as the NEON build of another CPU would.
no_wide_vectors() {
  local so
  so=$(echo "$work/site-$1"/cnr_torchrec/_C*.so)
  if ! command -v objdump >/dev/null; then echo "  objdump not found: not checked"; return; fi
  local n
  n=$(objdump -d --no-show-raw-insn "$so" | grep -cE '%[yz]mm' || true)
  echo "  $(basename "$so"): $n instructions on ymm/zmm registers"
  [ "$n" -eq 0 ] || { echo "the portable build holds AVX code"; return 1; }
}
same_digest() {
  local a b
  a=$(run_in cpu "$cpu_venv" "$src/scripts/install_check.py" digest)
  b=$(run_in portable "$cpu_venv" "$src/scripts/install_check.py" digest)
  echo "  codec digest: default $a, portable $b"
  [ "$a" = "$b" ] || { echo "the portable build encodes or decodes different bytes"; return 1; }
}
portable_tests() {
  rm -rf "$work/tests-portable"
  mkdir "$work/tests-portable"
  cp -a "$src/tests" "$src/pyproject.toml" "$work/tests-portable/"
  (cd "$work/tests-portable" && run_in portable "$cpu_venv" "$src/scripts/portable_tests.py")
}

aarch64_compiles() {
  local inc
  # torch's headers and Python.h (ops.cpp's module init): host headers that suit any LP64 Linux.
  inc=$("$cpu_venv/bin/python" -c 'import sysconfig; from torch.utils.cpp_extension import include_paths
print(" ".join("-I" + p for p in include_paths() + [sysconfig.get_paths()["include"]]))')
  # $inc is a list of flags, split on purpose.
  printf '%s\0' "$src"/csrc/*.cpp "$src"/csrc/cpu/*.cpp |
    xargs -0 -n 1 -P "${MAX_JOBS:-2}" aarch64-linux-gnu-g++ -c -std=c++20 -O3 -fopenmp -DNDEBUG -fPIC -w $inc -o /dev/null
  echo "  csrc/*.cpp and csrc/cpu/*.cpp compile for aarch64"
}
imports_ok() {  # imports_ok NAME VENV
  run_in "$1" "$2" "$src/scripts/install_check.py" imports "$src" "$work/site-$1"
}

total=$SECONDS
fresh_copy cpu
step "cpu: dependencies satisfied (pip install --dry-run --no-index)" deps_satisfied cpu "$cpu_venv"
build_and_install cpu "$cpu_venv"
step "cpu: import from outside the tree" imports_ok cpu "$cpu_venv"

fresh_copy portable
build_and_install portable "$cpu_venv" CNR_PORTABLE=1
step "portable: import from outside the tree" imports_ok portable "$cpu_venv"
step "portable: no AVX instructions" no_wide_vectors portable
step "portable: same codec bytes as the default build" same_digest
step "portable: scripts/portable_tests.py (the CPU kernels' tests)" portable_tests
if command -v aarch64-linux-gnu-g++ >/dev/null; then
  step "aarch64: cross-compile the CPU sources" aarch64_compiles
else
  echo "install-check: aarch64-linux-gnu-g++ not found: the aarch64 compile is skipped"
fi

fresh_copy cuda
step "cuda: dependencies satisfied (pip install --dry-run --no-index)" deps_satisfied cuda "$cuda_venv"
build_and_install cuda "$cuda_venv"
step "cuda: import from outside the tree" imports_ok cuda "$cuda_venv"
step "cuda: every op has its CUDA kernel" run_in cuda "$cuda_venv" "$src/scripts/cuda_ops.py"

echo "install-check: passed in $((SECONDS - total)) s"
