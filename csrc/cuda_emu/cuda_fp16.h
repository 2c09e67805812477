// The emulated <cuda_fp16.h>: the __half type and its conversions (see
// cuda_runtime.h for the emulation, narrow_float.h for the rounding).
#pragma once

#include "narrow_float.h"

using __half = cnr_emu::Value16<cnr_emu::Binary16>;
static_assert(sizeof(__half) == 2, "__half is stored as two bytes");

inline __half __float2half(float f) { return __half::rounded(f, cnr_emu::Rounding::kNearestEven); }
inline __half __float2half_rn(float f) { return __half::rounded(f, cnr_emu::Rounding::kNearestEven); }
inline __half __float2half_rd(float f) { return __half::rounded(f, cnr_emu::Rounding::kDown); }
inline __half __float2half_ru(float f) { return __half::rounded(f, cnr_emu::Rounding::kUp); }
inline __half __float2half_rz(float f) { return __half::rounded(f, cnr_emu::Rounding::kTowardZero); }
inline float __half2float(__half h) { return h; }

inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return static_cast<short>(h.__x); }
inline __half __ushort_as_half(unsigned short bits) { return __half::from_bits(bits); }
inline __half __short_as_half(short bits) { return __half::from_bits(static_cast<unsigned short>(bits)); }

inline int __hisinf(__half h) { return h.infinity(); }
inline bool __hisnan(__half h) { return h.nan(); }
