#!/usr/bin/env bash
# The checks of a lent GPU machine (docs/gpu.md, "On a lent machine"), in two calls, since fbgemm-gpu's
# CUDA wheel is larger than one call carries. scripts/gpu_stack.sh prepares what they carry, then:
#
#   bash scripts/gpu_run.sh build    # call 1: stash the first part of the stack, build the extension
#   bash scripts/gpu_run.sh check    # call 2: the rest of the stack, the gpu tests, then the benchmarks
#   bash scripts/gpu_run.sh recheck  # or: the tests that failed in check, a profile, the 205 MB restore
#
# The stack is the machine's own torch with the fbgemm-gpu and torchrec releases that match it, carried
# in .gpu/: fb.* (fbgemm-gpu's files as a split tar.xz, every fatbin entry but sm_90 zeroed so that it
# compresses) and whl/ (torchrec and the pure-Python dependencies the machine lacks). Figures and logs go
# to $OUT, one file per step, written as each step ends.
set -u
OUT=${OUT:-/tmp/gpu-out}
STASH=/tmp/cnr-gpu
SITE=/tmp/site
mkdir -p "$OUT" "$STASH"
step() { echo "== $(date +%T) $*"; }

build() {
    step stash; cp .gpu/fb.aa "$STASH"/ || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    step build
    # The system compiler: the image's default wrapper links libstdc++ statically (docs/gpu.md).
    CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
        python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    cp cnr_torchrec/_C*.so "$STASH"/
    ldd cnr_torchrec/_C*.so | grep -E 'libstdc|libc10 ' | tee "$OUT/ldd.txt"
    step built
}

install_stack() {
    [ -f "$STASH/fb.aa" ] || { echo "the first call's stash is gone (a fresh machine): run build again"; exit 3; }
    cp -n "$STASH"/_C*.so cnr_torchrec/ 2>/dev/null
    mkdir -p "$SITE"
    cat "$STASH/fb.aa" .gpu/fb.ab | xz -dc | tar xf - -C "$SITE" || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/whl/*.whl \
        || exit 1
    export PYTHONPATH="$SITE:$PWD"
    python3 -c 'import torch, fbgemm_gpu, torchrec, cnr_torchrec.ops
print("torch", torch.__version__, "fbgemm_gpu", fbgemm_gpu.__version__, "torchrec", torchrec.__version__)' \
        2>&1 | grep -v Warning | tail -3
}

check() {
    install_stack
    export PYTHONUNBUFFERED=1
    step tests
    timeout 170 python3 -m pytest -m gpu -n 8 -p no:cacheprovider --timeout 150 -q -rA \
        tests/test_gpu.py tests/test_tracking_ops.py --junitxml "$OUT/gpu-tests.xml" >"$OUT/gpu-tests.log" 2>&1
    tail -25 "$OUT/gpu-tests.log"
    step tracking
    timeout 50 torchrun --standalone --nproc_per_node 1 benchmarks/tracking.py --device cuda --rounds 10 \
        --json "$OUT/tracking_cuda.json" --profile "$STASH/prof" 2>&1 | grep -v -i warn | tail -22
    cp "$STASH/prof.rank0.cnr.json" "$OUT/trace_tracked_step.json" 2>/dev/null
    step tracking, production-sized step
    timeout 70 torchrun --standalone --nproc_per_node 1 benchmarks/tracking.py --device cuda --rounds 4 \
        --rows 1000000 --batch-size 16384 --pooling 60 --extractions 3 --json "$OUT/tracking_cuda_large.json" \
        --profile "$STASH/prof_large" 2>&1 | grep -v -i warn | tail -22
    step restore and save, CUDA
    timeout 90 torchrun --standalone --nproc_per_node 1 benchmarks/scale.py --device cuda --sizes 2 \
        --dirty 0.27 --deltas 3 --compaction-cycle 0 --reps 2 --json "$OUT/scale_cuda.json" 2>&1 \
        | grep -v -i warn | tail -30
    step restore and save, CPU on the same machine
    timeout 80 torchrun --standalone --nproc_per_node 1 benchmarks/scale.py --device cpu --sizes 2 \
        --dirty 0.27 --deltas 3 --compaction-cycle 0 --reps 2 --json "$OUT/scale_cpu.json" 2>&1 \
        | grep -v -i warn | tail -30
    step tracking, CPU on the same machine
    timeout 40 torchrun --standalone --nproc_per_node 1 benchmarks/tracking.py --device cpu --rounds 2 \
        --extractions 2 --json "$OUT/tracking_cpu.json" 2>&1 | grep -v -i warn | tail -12
    step done
}

# A second round: the tests that failed in check, the tracked step's profile, and the 205 MB restore of the
# default config (benchmarks/checkpoint.py) on CUDA and on the CPU.
recheck() {
    install_stack
    export PYTHONUNBUFFERED=1
    step tests
    timeout 120 python3 -m pytest -m gpu -n 2 -p no:cacheprovider --timeout 110 -q -rA tests/test_gpu.py \
        -k "host_sync or mc_tables" >"$OUT/gpu-tests-2.log" 2>&1
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error|host syncs|File " "$OUT/gpu-tests-2.log" | tail -40
    step tracking profile
    timeout 50 torchrun --standalone --nproc_per_node 1 benchmarks/tracking.py --device cuda --rounds 3 \
        --extractions 2 --profile "$STASH/prof2" 2>&1 | grep -E "^(CheckNRun|no track|profiled|replayed)"
    cp "$STASH/prof2.rank0.cnr.json" "$OUT/trace_tracked_step_stacks.json" 2>/dev/null
    for device in cuda cpu; do
        step checkpoint.py "$device"
        timeout 90 torchrun --standalone --nproc_per_node 1 benchmarks/checkpoint.py --device "$device" \
            --policies consecutive,default --reps 3 --json "$OUT/checkpoint_$device.json" 2>&1 \
            | grep -v -i warn | tail -28
    done
    step done
}

case "${1:-}" in
    build) build ;;
    check) check ;;
    recheck) recheck ;;
    *) echo "usage: $0 build|check|recheck" >&2; exit 2 ;;
esac
