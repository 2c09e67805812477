// CNR_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...) launches a kernel.
//
// Under nvcc it is the triple-chevron launch. Compiled as host C++ for the CUDA
// emulation (CNR_CUDA_EMU, see csrc/cuda_emu/), the emulated <cuda_runtime.h>
// defines it instead, so one kernel source serves both.
#pragma once

#include <cuda_runtime.h>

#ifndef CNR_CUDA_EMU
#define CNR_LAUNCH(kernel, grid, block, shared_bytes, stream) kernel<<<(grid), (block), (shared_bytes), (stream)>>>
#endif
