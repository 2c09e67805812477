// The emulated <cuda_runtime.h>: with -I csrc/cuda_emu first on the include
// path and CNR_CUDA_EMU defined, csrc/cuda/*.cu compile unchanged as host C++
// (g++ -std=c++17 -ffp-contract=off) and their kernels run under the runtime of
// runtime.h. Only what our kernels use is here, plus its natural siblings; a
// CUDA feature that is missing fails to compile rather than run wrongly.
//
// Never on nvcc's include path: nvcc finds the toolkit's own header.
#pragma once

#ifndef CNR_CUDA_EMU
#error "csrc/cuda_emu/ is the CUDA emulation: compile with -DCNR_CUDA_EMU, and never put it on nvcc's include path"
#endif

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include "runtime.h"

// ---- qualifiers: every function is a host function here ----------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// No __noinline__: glibc spells __attribute__((__noinline__)), which the macro would break.
#define __constant__
// One copy per host thread, which runs one block at a time: all the threads of
// that block see it, as they see shared memory.
#define __shared__ static thread_local

// CNR_LAUNCH(kernel, grid, block, shared_bytes, stream)(args...): see runtime.h.
#define CNR_LAUNCH(kernel, grid, block, shared_bytes, stream)                                                   \
  ::cnr_emu::Launcher(#kernel, (grid), (block), (shared_bytes), (stream),                                      \
                      [](auto... cnr_emu_params) { kernel(cnr_emu_params...); })

// ---- runtime API --------------------------------------------------------------

typedef struct CUstream_st* cudaStream_t;

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
typedef enum cudaError cudaError_t;

inline cudaError_t cudaGetLastError() { return static_cast<cudaError_t>(cnr_emu::take_error()); }
inline cudaError_t cudaPeekAtLastError() { return static_cast<cudaError_t>(cnr_emu::peek_error()); }
inline const char* cudaGetErrorString(cudaError_t e) { return cnr_emu::error_string(e); }
// Launches finish before they return.
inline cudaError_t cudaDeviceSynchronize() { return cudaPeekAtLastError(); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaPeekAtLastError(); }

// ---- synchronization ------------------------------------------------------------

inline void __syncthreads() { cnr_emu::block_barrier(cnr_emu::BlockOp::kSync, 0); }
inline int __syncthreads_count(int p) { return cnr_emu::block_barrier(cnr_emu::BlockOp::kCount, p); }
inline int __syncthreads_and(int p) { return cnr_emu::block_barrier(cnr_emu::BlockOp::kAnd, p); }
inline int __syncthreads_or(int p) { return cnr_emu::block_barrier(cnr_emu::BlockOp::kOr, p); }
// One host thread runs the block: memory is coherent between its threads already.
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() { cnr_emu::fault("__trap() called"); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cnr_emu::warp_barrier(cnr_emu::WarpOp::kSync, mask, 0, 0, warpSize);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return cnr_emu::from_bits<T>(
      cnr_emu::warp_barrier(cnr_emu::WarpOp::kShfl, mask, cnr_emu::to_bits(var), src_lane, width));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return cnr_emu::from_bits<T>(cnr_emu::warp_barrier(cnr_emu::WarpOp::kShflUp, mask, cnr_emu::to_bits(var),
                                                     static_cast<int>(delta), width));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return cnr_emu::from_bits<T>(cnr_emu::warp_barrier(cnr_emu::WarpOp::kShflDown, mask, cnr_emu::to_bits(var),
                                                     static_cast<int>(delta), width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return cnr_emu::from_bits<T>(
      cnr_emu::warp_barrier(cnr_emu::WarpOp::kShflXor, mask, cnr_emu::to_bits(var), lane_mask, width));
}

inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(cnr_emu::warp_barrier(cnr_emu::WarpOp::kAny, mask, predicate != 0, 0, warpSize));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(cnr_emu::warp_barrier(cnr_emu::WarpOp::kAll, mask, predicate != 0, 0, warpSize));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(cnr_emu::warp_barrier(cnr_emu::WarpOp::kBallot, mask, predicate != 0, 0, warpSize));
}

// ---- atomics ----------------------------------------------------------------------
// The overloads CUDA has (no signed 64-bit add, for instance), so that code
// which nvcc rejects is rejected here too. Emulated threads never switch inside
// one; the __atomic builtins also keep concurrent launches from two host
// threads on the same memory correct.

namespace cnr_emu {
// Returns the old value, as CUDA's atomics do.
template <typename T, typename F>
inline T atomic_update(T* address, F update) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(address, &old, update(old), true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomic_cas(T* address, T expected, T desired) {
  __atomic_compare_exchange_n(address, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;  // the old value, whether or not it matched
}
inline float atomic_add_float(float* address, float v) {
  auto* word = reinterpret_cast<uint32_t*>(address);
  const uint32_t old = atomic_update(word, [v](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    f += v;
    std::memcpy(&bits, &f, sizeof f);
    return bits;
  });
  float f;
  std::memcpy(&f, &old, sizeof f);
  return f;
}
}  // namespace cnr_emu

#define CNR_EMU_ATOMIC_INT(name, builtin)                                                                    \
  inline int name(int* a, int v) { return builtin(a, v, __ATOMIC_RELAXED); }                                \
  inline unsigned name(unsigned* a, unsigned v) { return builtin(a, v, __ATOMIC_RELAXED); }                  \
  inline unsigned long long name(unsigned long long* a, unsigned long long v) {                              \
    return builtin(a, v, __ATOMIC_RELAXED);                                                                  \
  }
CNR_EMU_ATOMIC_INT(atomicAdd, __atomic_fetch_add)
CNR_EMU_ATOMIC_INT(atomicAnd, __atomic_fetch_and)
CNR_EMU_ATOMIC_INT(atomicOr, __atomic_fetch_or)
CNR_EMU_ATOMIC_INT(atomicXor, __atomic_fetch_xor)
CNR_EMU_ATOMIC_INT(atomicExch, __atomic_exchange_n)
#undef CNR_EMU_ATOMIC_INT

inline float atomicAdd(float* a, float v) { return cnr_emu::atomic_add_float(a, v); }
inline int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }
inline unsigned atomicSub(unsigned* a, unsigned v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }

#define CNR_EMU_ATOMIC_MINMAX(T)                                                               \
  inline T atomicMin(T* a, T v) { return cnr_emu::atomic_update(a, [v](T o) { return v < o ? v : o; }); } \
  inline T atomicMax(T* a, T v) { return cnr_emu::atomic_update(a, [v](T o) { return v > o ? v : o; }); }
CNR_EMU_ATOMIC_MINMAX(int)
CNR_EMU_ATOMIC_MINMAX(unsigned)
CNR_EMU_ATOMIC_MINMAX(long long)
CNR_EMU_ATOMIC_MINMAX(unsigned long long)
#undef CNR_EMU_ATOMIC_MINMAX

inline int atomicCAS(int* a, int c, int v) { return cnr_emu::atomic_cas(a, c, v); }
inline unsigned atomicCAS(unsigned* a, unsigned c, unsigned v) { return cnr_emu::atomic_cas(a, c, v); }
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long c, unsigned long long v) {
  return cnr_emu::atomic_cas(a, c, v);
}
inline unsigned short atomicCAS(unsigned short* a, unsigned short c, unsigned short v) {
  return cnr_emu::atomic_cas(a, c, v);
}

// ---- integer intrinsics -------------------------------------------------------------

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i, x >>= 1) r = (r << 1) | (x & 1u);
  return r;
}

// ---- float intrinsics ---------------------------------------------------------------
// IEEE single precision with round-to-nearest-even, as the _rn intrinsics are:
// host float arithmetic is exactly that on x86-64 (SSE) and AArch64, provided
// nothing is contracted into an FMA, hence -ffp-contract=off.

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

// fminf / fmaxf as the device computes them (PTX min / max: IEEE 754-2019
// minimumNumber / maximumNumber): a NaN is missing data, two NaNs give the
// canonical NaN, and -0 < +0. glibc's may return either zero, so kernels are
// routed here by macro (the rest of <cmath> rounds as the device does).
namespace cnr_emu {
inline float device_fminmax(float a, float b, bool max) {
  if (std::isnan(a) && std::isnan(b)) return from_bits<float>(0x7fffffffu);
  if (std::isnan(a)) return b;
  if (std::isnan(b)) return a;
  if (a == b) return std::signbit(a) == max ? b : a;  // only +0 and -0 are equal and differ
  return (a > b) == max ? a : b;
}
inline float device_fminf(float a, float b) { return device_fminmax(a, b, false); }
inline float device_fmaxf(float a, float b) { return device_fminmax(a, b, true); }
}  // namespace cnr_emu
#define fminf ::cnr_emu::device_fminf
#define fmaxf ::cnr_emu::device_fmaxf

inline int __float_as_int(float f) { return cnr_emu::from_bits<int>(cnr_emu::to_bits(f)); }
inline unsigned __float_as_uint(float f) { return cnr_emu::from_bits<unsigned>(cnr_emu::to_bits(f)); }
inline float __int_as_float(int i) { return cnr_emu::from_bits<float>(cnr_emu::to_bits(i)); }
inline float __uint_as_float(unsigned u) { return cnr_emu::from_bits<float>(cnr_emu::to_bits(u)); }
