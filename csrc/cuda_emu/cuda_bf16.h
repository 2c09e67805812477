// The emulated <cuda_bf16.h>: the __nv_bfloat16 type and its conversions (see
// cuda_runtime.h for the emulation, narrow_float.h for the rounding).
#pragma once

#include "narrow_float.h"

using __nv_bfloat16 = cnr_emu::Value16<cnr_emu::BFloat16>;
static_assert(sizeof(__nv_bfloat16) == 2, "__nv_bfloat16 is stored as two bytes");

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16::rounded(f, cnr_emu::Rounding::kNearestEven); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __nv_bfloat16::rounded(f, cnr_emu::Rounding::kNearestEven);
}
inline __nv_bfloat16 __float2bfloat16_rd(float f) { return __nv_bfloat16::rounded(f, cnr_emu::Rounding::kDown); }
inline __nv_bfloat16 __float2bfloat16_ru(float f) { return __nv_bfloat16::rounded(f, cnr_emu::Rounding::kUp); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  return __nv_bfloat16::rounded(f, cnr_emu::Rounding::kTowardZero);
}
inline float __bfloat162float(__nv_bfloat16 h) { return h; }

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return __nv_bfloat16::from_bits(bits); }

inline int __hisinf(__nv_bfloat16 h) { return h.infinity(); }
inline bool __hisnan(__nv_bfloat16 h) { return h.nan(); }
