"""The CUDA emulation itself (csrc/cuda_emu/), through the kernels of csrc/cuda_emu/selftest.cpp.

Warp and block operations must give CUDA's results; kernels that CUDA would hang on or
that misuse warp masks, and launches CUDA refuses, must raise a clear error instead, and
leave the emulation usable. Both ways of switching between threads are tested.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from cnr_torchrec import _cuda_emu

emu = _cuda_emu.load()


def expected_warp_semantics() -> torch.Tensor:
    rows = []
    for block in range(2):
        for t in range(64):
            lane = t % 32
            base16 = lane - lane % 16
            rows.append([
                ((lane + 3) % 32) * 10,
                lane - 2 if lane >= 2 else lane,
                lane + 5 if lane + 5 < base16 + 16 else lane,
                (lane ^ 1) * 2,
                sum(1 << i for i in range(32) if i % 3 == 0),
                1 + 2 * (t < 32),  # any(lane == 7) + 2 * all(t < 40) over the warp
                32,  # threads with even t
                0 + 2 * 1,  # and(t < 63) + 2 * or(t == 63)
                sum(i * i for i in range(64)),
                (15 - lane) + 100 if lane < 16 else -1,
            ])
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("switch", ["fast", "ucontext"])
def test_warp_and_block_operations_follow_cuda(switch):
    with mock.patch.dict(os.environ, {"CNR_CUDA_EMU_SWITCH": switch}):
        assert torch.equal(emu.selftest("warp_semantics"), expected_warp_semantics())


KERNEL_FAULTS = {
    "deadlock": "deadlock, no thread can run: 16 threads wait at __syncthreads",
    "exited_lane": "lane 16, named in the mask, has exited",
    "foreign_mask": "which is not in the mask",
    "partial_warp": "is not a thread of this block",
    "trap": r"block \(\d, 0, 0\), thread \(5, 0, 0\).*__trap",
    "nested_launch": "dynamic parallelism is not emulated",
}


@pytest.mark.parametrize("switch", ["fast", "ucontext"])
@pytest.mark.parametrize("name", KERNEL_FAULTS)
def test_kernel_faults_raise_instead_of_hanging(switch, name):
    with mock.patch.dict(os.environ, {"CNR_CUDA_EMU_SWITCH": switch}):
        with pytest.raises(RuntimeError, match=KERNEL_FAULTS[name]):
            emu.selftest(name)
        # The abandoned block's fibers and stacks are reused as they were.
        assert torch.equal(emu.selftest("warp_semantics"), expected_warp_semantics())


@pytest.mark.parametrize("name", ["block_too_large", "block_too_deep", "empty_block", "grid_x_too_large",
                                  "grid_y_too_large", "too_much_shared"])
def test_bad_launch_configurations_are_reported_by_check_launch(name):
    with pytest.raises(RuntimeError, match=r"CUDA error: invalid (configuration )?argument"):
        emu.selftest(name)
    assert torch.equal(emu.selftest("warp_semantics"), expected_warp_semantics())  # the error was cleared


def test_a_bad_seed_is_a_clear_error():
    bad_seed = mock.patch.dict(os.environ, {"CNR_CUDA_EMU_SEED": "many"})
    with bad_seed, pytest.raises(ValueError, match="CNR_CUDA_EMU_SEED must be an integer"):
        emu.selftest("racy")
