// Small kernels that test the emulation itself (tests/test_cuda_emulation.py
// runs them through torch.ops.cnr_emu.selftest): the semantics of the warp and
// block operations, and the errors of kernels that CUDA would hang on, misuse
// warp masks, or cannot launch. Written as CUDA, compiled only here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <cuda_runtime.h>

#include <string>

namespace cnr_emu {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kOutputs = 10;  // values each thread of warp_semantics writes

// Every warp operation and block reduction, with results a test can predict.
__global__ void warp_semantics_kernel(int64_t* out) {
  __shared__ int64_t slots[64];
  const int t = static_cast<int>(threadIdx.x), lane = t % 32;
  int64_t* o = out + (blockIdx.x * blockDim.x + t) * kOutputs;
  o[0] = __shfl_sync(kFull, lane * 10, lane + 3);        // wraps within the warp
  o[1] = __shfl_up_sync(kFull, lane, 2);                 // lanes 0, 1 keep their own
  o[2] = __shfl_down_sync(kFull, lane, 5, 16);           // within groups of 16
  o[3] = __shfl_xor_sync(kFull, static_cast<double>(lane), 1) * 2.0;
  o[4] = __ballot_sync(kFull, lane % 3 == 0);
  o[5] = __any_sync(kFull, lane == 7) + 2 * __all_sync(kFull, t < 40);
  o[6] = __syncthreads_count(t % 2 == 0);
  o[7] = __syncthreads_and(t < 63) + 2 * __syncthreads_or(t == 63);
  slots[t] = t * t;  // a block reduction through shared memory
  __syncthreads();
  for (int s = 32; s > 0; s >>= 1) {
    if (t < s) slots[t] += slots[t + s];
    __syncthreads();
  }
  o[8] = slots[0];
  if (lane < 16) {  // a half-warp mask: the other half has already moved on
    o[9] = __shfl_sync(0x0000ffffu, lane + 100, 15 - lane);
  } else {
    o[9] = -1;
  }
}

// Without a barrier, which thread writes the slot last depends on the order
// threads run in: the seed shows through.
__global__ void racy_kernel(int64_t* out) {
  __shared__ int64_t last;
  last = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = last;
}

// Lanes 0-15 wait at __syncthreads while 16-31 wait at a full-warp __syncwarp: CUDA hangs.
__global__ void deadlock_kernel(int64_t* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

// The upper half-warp exits before the full-mask shuffle.
__global__ void exited_lane_kernel(int64_t* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_sync(kFull, static_cast<int64_t>(threadIdx.x), 0);
}

// Each lane names a mask without itself.
__global__ void foreign_mask_kernel(int64_t* out) {
  out[threadIdx.x] = __shfl_sync(1u << ((threadIdx.x + 1) % 32), 1, 0);
}

// A block of 48 threads: its second warp has 16 lanes, and the mask names 32.
__global__ void partial_warp_kernel(int64_t* out) {
  __syncwarp();
  out[threadIdx.x] = 1;
}

__global__ void trap_kernel(int64_t* out) {
  if (threadIdx.x == 5) __trap();
  out[threadIdx.x] = 1;
}

__global__ void nested_launch_kernel(int64_t* out) {
  CNR_LAUNCH(racy_kernel, 1, 32, 0, nullptr)(out);
}

}  // namespace

// Runs test `name` and returns what its threads wrote; a bad launch configuration
// is raised by cnr_emu::check_launch(), as the bind files do.
at::Tensor run_selftest(const std::string& name) {
  auto out = at::zeros({128 * kOutputs}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  if (name == "warp_semantics") {
    CNR_LAUNCH(warp_semantics_kernel, 2, 64, 0, nullptr)(p);
    out = out.view({128, kOutputs});
  } else if (name == "racy") {
    CNR_LAUNCH(racy_kernel, 16, 256, 0, nullptr)(p);
    out = out.narrow(0, 0, 16);
  } else if (name == "deadlock") {
    CNR_LAUNCH(deadlock_kernel, 1, 32, 0, nullptr)(p);
  } else if (name == "exited_lane") {
    CNR_LAUNCH(exited_lane_kernel, 1, 32, 0, nullptr)(p);
  } else if (name == "foreign_mask") {
    CNR_LAUNCH(foreign_mask_kernel, 1, 32, 0, nullptr)(p);
  } else if (name == "partial_warp") {
    CNR_LAUNCH(partial_warp_kernel, 1, 48, 0, nullptr)(p);
  } else if (name == "trap") {
    CNR_LAUNCH(trap_kernel, 3, 32, 0, nullptr)(p);
  } else if (name == "nested_launch") {
    CNR_LAUNCH(nested_launch_kernel, 1, 1, 0, nullptr)(p);
  } else if (name == "block_too_large") {
    CNR_LAUNCH(racy_kernel, 1, 1025, 0, nullptr)(p);
  } else if (name == "block_too_deep") {
    CNR_LAUNCH(racy_kernel, 1, dim3(1, 1, 65), 0, nullptr)(p);
  } else if (name == "empty_block") {
    CNR_LAUNCH(racy_kernel, 1, 0, 0, nullptr)(p);
  } else if (name == "grid_x_too_large") {
    CNR_LAUNCH(racy_kernel, dim3(1u << 31), 32, 0, nullptr)(p);
  } else if (name == "grid_y_too_large") {
    CNR_LAUNCH(racy_kernel, dim3(1, 65536), 32, 0, nullptr)(p);
  } else if (name == "too_much_shared") {
    CNR_LAUNCH(racy_kernel, 1, 32, 64 * 1024, nullptr)(p);
  } else {
    TORCH_CHECK_VALUE(false, "cnr_emu::selftest: no test named '", name, "'");
  }
  check_launch();
  return out;
}

}  // namespace cnr_emu
