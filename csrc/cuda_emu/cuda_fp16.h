// The emulated <cuda_fp16.h>: the __half type and its conversions (see
// cuda_runtime.h for the emulation, narrow_float.h for the rounding).
#pragma once

#include <cstdint>

#include "narrow_float.h"

struct __half {
  unsigned short __x;  // the binary16 bits, as CUDA names them
  __half() = default;
  __half(float f)  // NOLINT: implicit, as in CUDA; rounds to nearest even
      : __x(cnr_emu::Binary16::from_float(f, cnr_emu::Rounding::kNearestEven)) {}
  operator float() const { return cnr_emu::Binary16::to_float(__x); }  // NOLINT: as in CUDA
};
static_assert(sizeof(__half) == 2, "__half is stored as two bytes");

namespace cnr_emu {
inline __half half_from_bits(unsigned short bits) {
  __half h;
  h.__x = bits;
  return h;
}
inline __half to_half(float f, Rounding mode) { return half_from_bits(Binary16::from_float(f, mode)); }
}  // namespace cnr_emu

inline __half __float2half(float f) { return cnr_emu::to_half(f, cnr_emu::Rounding::kNearestEven); }
inline __half __float2half_rn(float f) { return cnr_emu::to_half(f, cnr_emu::Rounding::kNearestEven); }
inline __half __float2half_rd(float f) { return cnr_emu::to_half(f, cnr_emu::Rounding::kDown); }
inline __half __float2half_ru(float f) { return cnr_emu::to_half(f, cnr_emu::Rounding::kUp); }
inline __half __float2half_rz(float f) { return cnr_emu::to_half(f, cnr_emu::Rounding::kTowardZero); }
inline float __half2float(__half h) { return cnr_emu::Binary16::to_float(h.__x); }

inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return static_cast<short>(h.__x); }
inline __half __ushort_as_half(unsigned short bits) { return cnr_emu::half_from_bits(bits); }
inline __half __short_as_half(short bits) { return cnr_emu::half_from_bits(static_cast<unsigned short>(bits)); }

// -1 for -inf, 1 for +inf, else 0.
inline int __hisinf(__half h) { return h.__x == 0x7c00u ? 1 : (h.__x == 0xfc00u ? -1 : 0); }
inline bool __hisnan(__half h) { return (h.__x & 0x7fffu) > 0x7c00u; }
