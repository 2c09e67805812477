#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) for scripts/gpu_run.sh: the fbgemm-gpu and torchrec releases that match the
# lent machine's torch (2.11.0+cu130 there; docs/gpu.md), with what torchrec, torchsnapshot and the tests
# need that the machine lacks, as wheels. fbgemm-gpu's CUDA wheel (465 MB) is unpacked, every fatbin entry
# but sm_90 is zeroed (scripts/fatbin_keep_arch.py), and the tree is carried as a tar.xz split in two
# (82 MB in all), one part per call.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platform=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${platform[@]}" -d "$work" fbgemm-gpu==1.6.0
python3 -m pip download -q "${platform[@]}" -d .gpu/whl torchrec==1.6.1 tensordict==0.15.3 pyvers==0.2.3 \
    iopath==0.1.9 torchsnapshot==0.1.0 importlib_metadata==8.7.0 lazy-importer==0.1.0 aiofiles==25.1.0 \
    nest-asyncio==1.6.0 torchdata==0.11.0 google-crc32c==1.7.1 pytest-timeout==2.4.0
(cd "$work" && python3 -m zipfile -e fbgemm_gpu-*.whl tree)
python3 scripts/fatbin_keep_arch.py 90 "$work"/tree/fbgemm_gpu/*.so
tar cf - -C "$work/tree" . | xz -T0 -6 >"$work/fbgemm.tar.xz"
split -b 56M "$work/fbgemm.tar.xz" .gpu/fb.
ls -l .gpu .gpu/whl
