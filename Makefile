# Set-up is incremental: the venv is rebuilt only when the pins change, and the
# extension only when its sources change.
# STACK: which tested TorchRec stack (stacks/STACK.env) the venv holds. The repository's own default is
# 1.8, the lighter one (torch 2.13's CPU build: a fresh `make demo` in 146 s against 249 s on 1.9's 5.3 GB
# CUDA torch, docs/install.md); `make test-stack STACK=1.9` runs the named suite on the newest in .venv-1.9.
STACK  ?= 1.8
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-stamp-$(STACK)
EXT    := $(VENV)/.ext-stamp
EMU    := $(VENV)/.emu-stamp
TEST_DEPS := $(VENV)/.test-deps-stamp
CSRC   := $(shell find csrc -type f 2>/dev/null)
NPROC  ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_ARGS ?=

.PHONY: install test test-stack lint demo bench bench-checkpoint bench-cpr scale soak accuracy accuracy-seed accuracy-combine nvcc-check cuda-check clean reliability

install: $(EXT)

$(DEPS): requirements.txt requirements-torchrec.txt stacks/$(STACK).env scripts/install.sh
	@echo "set-up, before anything else (the first run, or new pins): about 1.5 minutes on an idle 2-core machine for stack 1.8 (3 for 1.9, whose torch is the CUDA build), a venv with the pinned stack $(STACK), then the C++ extension (about 1 minute). Later runs skip both."
	STACK=$(STACK) bash scripts/install.sh $(VENV)
	@touch $@

# What the tests need besides (pytest, the moto S3 server, matplotlib).
$(TEST_DEPS): $(DEPS) requirements-test.txt
	@echo "set-up: the tests' own requirements (about 1 minute)"
	STACK=$(STACK) bash scripts/install.sh $(VENV) requirements-test.txt
	@touch $@

# The library's extension, cnr_torchrec._C: all that the library, the demo and the benchmarks load.
$(EXT): $(DEPS) setup.py $(CSRC)
	@echo "set-up: building cnr_torchrec._C with $(NPROC) jobs (1 to 1.5 minutes on 2 cores)"
	MAX_JOBS=$(NPROC) $(PY) -m pip install --disable-pip-version-check -q --no-build-isolation --no-deps -e .
	$(PY) -m compileall -q cnr_torchrec cnr_dlrm  # as scripts/install.sh does for the venv
	@touch $@

# The CUDA kernels of csrc/cuda/ compiled for the CPU (cnr_torchrec._C_cuda_emu), which only the tests load.
$(EMU): $(EXT)
	@echo "set-up: building the emulated CUDA kernels for the tests (about 1 minute on 2 cores)"
	@# Its compiler output goes to a log, shown only if it fails (pip -q hides _C's the same way).
	CNR_CUDA_EMU=only MAX_JOBS=$(NPROC) $(PY) setup.py -q build_ext --inplace > $(VENV)/emu-build.log 2>&1 \
	  || { tail -n 60 $(VENV)/emu-build.log; exit 1; }
	@touch $@

# Compile-check the CUDA sources (they include no torch header) wherever nvcc exists.
nvcc-check:
	@if command -v nvcc >/dev/null 2>&1; then \
	  for f in csrc/cuda/*.cu; do \
	    echo "nvcc -c $$f"; nvcc -std=c++17 -O2 -c $$f -o /tmp/cnr-nvcc-check.o || exit 1; \
	  done; \
	else echo "nvcc not found: CUDA compile-check skipped"; fi

# The CUDA build, on any machine with the CUDA toolkit (no GPU needed): a second venv with the CUDA
# builds of torch and fbgemm-gpu, user-style wheel installs into both venvs (scripts/install_check.sh),
# the whole extension built in a copy of the tree, a check that every op on the training, save and
# restore paths has a CUDA kernel, then the test suite against it.
CUDA_VENV ?= .venv-cuda
CUDA_DEPS := $(CUDA_VENV)/.deps-stamp

$(CUDA_DEPS): requirements.txt requirements-torchrec.txt requirements-test.txt stacks/$(STACK).env scripts/install_cuda.sh scripts/nvml_stub.c
	STACK=$(STACK) bash scripts/install_cuda.sh $(CUDA_VENV)
	@touch $@

cuda-check: $(CUDA_DEPS) $(TEST_DEPS)
	CPU_VENV=$(VENV) bash scripts/cuda_check.sh $(CUDA_VENV) .cuda-build $(PYTEST_ARGS)

test: lint $(EMU) $(TEST_DEPS) nvcc-check
	$(PY) -m pytest $(PYTEST_ARGS)

# The named suite on another tested stack, in its own venv (.venv-1.9 for STACK=1.9): tracking on every
# sharding type and kernel, exact restores of TorchRec's models, managed-collision tables, the pipelines,
# the dense optimizers, a job's exit, and what reads TorchRec's and FBGEMM's modules from outside a restore (the
# follower's quantized TBEs and managed-collision modules, warm start, will_restore's recording of TorchRec's
# initialisation); docs/testing.md says why these files.
STACK_SUITE := tests/test_stack.py tests/test_tracking_ops.py tests/test_tracker_multirank.py \
  tests/test_torchrec_models.py tests/test_managed_collision.py tests/test_pipelines.py \
  tests/test_dense_optimizers.py tests/test_tbe_cache.py tests/test_dropin.py tests/test_quickstart.py \
  tests/test_exit.py tests/test_publish.py tests/test_publish_mc.py tests/test_warm_start.py \
  tests/test_deferred_init.py
# The extension is built in place, so the other stack builds in a copy of the tree (.stack-1.9/, refreshed
# from the working tree each time: an unchanged source keeps its build there).
test-stack:
	mkdir -p .stack-$(STACK)
	git ls-files -z --cached --others --exclude-standard | tar --null -T - -c | tar -x -C .stack-$(STACK)
	$(MAKE) -C .stack-$(STACK) test STACK=$(STACK) VENV=$(CURDIR)/.venv-$(STACK) \
	  PYTEST_ARGS="$(STACK_SUITE) $(PYTEST_ARGS)"

# The linter and the type checker over the library (their config is in pyproject.toml).
lint: $(TEST_DEPS)
	$(VENV)/bin/ruff check cnr_torchrec
	$(VENV)/bin/mypy

# The example job (cnr_dlrm/, beside the library, not in its wheel): torchrun's `-m` workers start in this
# directory, which is how they find it. `python -m cnr_dlrm.report /tmp/cnr_demo --out plots/` plots the run
# (with matplotlib, which `make test` installs; `make demo` alone does not).
demo: install
	@echo "demo: 2 ranks, 1,200 steps; rank 1 is killed at step 830 and the job resumes from its checkpoints (a little over a minute)"
	rm -rf /tmp/cnr_demo
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 --max-restarts 1 \
	  -m cnr_dlrm.train --config configs/demo.yaml --fail-at-step 830 --fail-rank 1

bench: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/tracking.py

bench-checkpoint: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint.py --json checkpoint_bench.json

bench-cpr: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/cpr.py --json cpr_bench.json

# Sizes 1x, 10x, 25x (5.28 GB) at 1/10/27% dirty, with torchsnapshot and DCP beside it (~4 min); docs/scale.md.
scale: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/scale.py --reps 1 --json out/scale.json

# 500 checkpoints with background compaction beside the same job without it (~10 min); docs/compaction.md.
soak: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/soak.py --json soak.json

# The accuracy study, seed 0: plain and residual with their controls, and residual with background compaction
# (production only: harsh restores right after every save, which leaves no compaction time to fold), whose
# controls are the residual arm's (they use neither) (~45 min in all on this machine); docs/accuracy.md.
ACC := OMP_NUM_THREADS=1 $(PY) benchmarks/accuracy.py
accuracy: install
	$(ACC) --task harsh --json out/accuracy-harsh.json --markdown out/accuracy-harsh.md
	$(ACC) --task production --methods adaptive --json out/accuracy-production.json --markdown out/accuracy-production.md
	$(ACC) --task harsh --methods adaptive --residual --json out/accuracy-harsh-residual.json --markdown out/accuracy-harsh-residual.md
	$(ACC) --task production --methods adaptive --residual --json out/accuracy-production-residual.json --markdown out/accuracy-production-residual.md
	$(ACC) --task production --methods adaptive --residual --compaction 4 --no-controls --json out/accuracy-production-residual-compaction.json

# One more seed of the adaptive grid of every arm, without controls (~45 min per seed with two at a time on
# 2 cores): make accuracy-seed SEED=1.
SEED ?= 1
accuracy-seed: install
	$(ACC) --task harsh --methods adaptive --seed $(SEED) --no-controls --json out/accuracy-harsh-s$(SEED).json
	$(ACC) --task production --methods adaptive --seed $(SEED) --no-controls --json out/accuracy-production-s$(SEED).json
	$(ACC) --task harsh --methods adaptive --residual --seed $(SEED) --no-controls --json out/accuracy-harsh-residual-s$(SEED).json
	$(ACC) --task production --methods adaptive --residual --seed $(SEED) --no-controls --json out/accuracy-production-residual-s$(SEED).json
	$(ACC) --task production --methods adaptive --residual --compaction 4 --seed $(SEED) --no-controls --json out/accuracy-production-residual-compaction-s$(SEED).json

# Every arm over the seeds in out/ (seconds): out/accuracy-<arm>-seeds.json, the tables bits: auto derives from.
accuracy-combine: install
	for arm in harsh production harsh-residual production-residual; do \
	  $(PY) benchmarks/accuracy_seeds.py out/accuracy-$$arm.json out/accuracy-$$arm-s[0-9]*.json \
	    --json out/accuracy-$$arm-seeds.json --markdown out/accuracy-$$arm-seeds.md || exit 1; done
	$(PY) benchmarks/accuracy_seeds.py out/accuracy-production-residual-compaction.json \
	  out/accuracy-production-residual-compaction-s[0-9]*.json --controls-from out/accuracy-production-residual.json \
	  --json out/accuracy-production-residual-compaction-seeds.json --markdown out/accuracy-production-residual-compaction-seeds.md

clean:
	rm -rf build *.egg-info cnr_torchrec/_C*.so $(EXT) $(EMU) .cuda-build .stack-*

# The long end-to-end tests (`pytest -m long`: faster cases of the same checks run in `make test`), then
# 100 SIGKILLs at fault points and random moments, the corruption matrix, ENOSPC and S3 (moto), then a job on
# two torchrun nodes killed mid-save and resharded 4 -> 2 -> 4 ranks, then 80 jobs that end right after their
# collectives, half without the exit handler; see docs/reliability.md.
reliability: install $(TEST_DEPS)
	$(PY) -m pytest -m long
	OMP_NUM_THREADS=1 $(PY) benchmarks/reliability.py --kills 100 --json out/reliability.json
	OMP_NUM_THREADS=1 $(PY) benchmarks/multinode.py --json out/multinode.json
	$(PY) benchmarks/exit_race.py --jobs 40 --json out/exit_race.json
