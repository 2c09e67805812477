// The emulated <cuda_bf16.h>: the __nv_bfloat16 type and its conversions (see
// cuda_runtime.h for the emulation, narrow_float.h for the rounding).
#pragma once

#include <cstdint>

#include "narrow_float.h"

struct __nv_bfloat16 {
  unsigned short __x;  // the bfloat16 bits, as CUDA names them
  __nv_bfloat16() = default;
  __nv_bfloat16(float f)  // NOLINT: implicit, as in CUDA; rounds to nearest even
      : __x(cnr_emu::BFloat16::from_float(f, cnr_emu::Rounding::kNearestEven)) {}
  operator float() const { return cnr_emu::BFloat16::to_float(__x); }  // NOLINT: as in CUDA
};
static_assert(sizeof(__nv_bfloat16) == 2, "__nv_bfloat16 is stored as two bytes");

namespace cnr_emu {
inline __nv_bfloat16 bfloat16_from_bits(unsigned short bits) {
  __nv_bfloat16 h;
  h.__x = bits;
  return h;
}
inline __nv_bfloat16 to_bfloat16(float f, Rounding mode) { return bfloat16_from_bits(BFloat16::from_float(f, mode)); }
}  // namespace cnr_emu

inline __nv_bfloat16 __float2bfloat16(float f) { return cnr_emu::to_bfloat16(f, cnr_emu::Rounding::kNearestEven); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return cnr_emu::to_bfloat16(f, cnr_emu::Rounding::kNearestEven); }
inline __nv_bfloat16 __float2bfloat16_rd(float f) { return cnr_emu::to_bfloat16(f, cnr_emu::Rounding::kDown); }
inline __nv_bfloat16 __float2bfloat16_ru(float f) { return cnr_emu::to_bfloat16(f, cnr_emu::Rounding::kUp); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) { return cnr_emu::to_bfloat16(f, cnr_emu::Rounding::kTowardZero); }
inline float __bfloat162float(__nv_bfloat16 h) { return cnr_emu::BFloat16::to_float(h.__x); }

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return cnr_emu::bfloat16_from_bits(bits); }

// -1 for -inf, 1 for +inf, else 0.
inline int __hisinf(__nv_bfloat16 h) { return h.__x == 0x7f80u ? 1 : (h.__x == 0xff80u ? -1 : 0); }
inline bool __hisnan(__nv_bfloat16 h) { return (h.__x & 0x7fffu) > 0x7f80u; }
