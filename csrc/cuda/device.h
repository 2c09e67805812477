// What the bind files (csrc/cuda/*_bind.cpp) need of a device, in one place, so
// that the same bind source serves two builds:
//
// - the CUDA build: ops registered for the CUDA dispatch key of `cnr`, kernels
//   launched on torch's current stream;
// - the emulated build (CNR_CUDA_EMU, csrc/cuda_emu/): the kernels run under the
//   CUDA emulation on host memory, and the ops are registered for the CPU key of
//   a second library, `cnr_emu`, so tests call both backends side by side.
//
// Every read of device memory by the host goes through to_host(), so the
// emulated build can count them (torch.ops.cnr_emu.host_reads()): a test holds
// the hot-path ops to zero.
#pragma once

#include <ATen/core/Tensor.h>

#include <cuda_runtime.h>

#ifdef CNR_CUDA_EMU
#define CNR_DEVICE_LIB cnr_emu
#define CNR_DEVICE_KEY CPU
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define CNR_DEVICE_LIB cnr
#define CNR_DEVICE_KEY CUDA
#endif

namespace cnr::device {

#ifdef CNR_CUDA_EMU
struct Guard {
  explicit Guard(c10::Device) {}
};
inline cudaStream_t stream() { return nullptr; }
inline void check_launch() { cnr_emu::check_launch(); }
void count_host_read();  // csrc/cuda_emu/emu_ops.cpp
#else
using Guard = c10::cuda::CUDAGuard;
inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }
inline void check_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }
inline void count_host_read() {}
#endif

// A host copy of `t`: on CUDA, a device-to-host copy that waits for the stream.
inline at::Tensor to_host(const at::Tensor& t) {
  count_host_read();
  return t.cpu();
}

}  // namespace cnr::device
