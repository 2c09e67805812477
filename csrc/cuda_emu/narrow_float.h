// Float32 to and from the 16-bit formats of the emulated <cuda_fp16.h> and
// <cuda_bf16.h>, derived from the IEEE 754 definitions: binary16 (5 exponent
// bits, 10 stored significand bits) and bfloat16 (float32's 8 exponent bits, 7
// significand bits).
//
// Narrowing rounds as CUDA's conversions document: to nearest even (_rn),
// toward -inf (_rd), toward +inf (_ru) or toward zero (_rz), with gradual
// underflow to subnormals and overflow to inf where the rounding direction
// leaves the format (else to the largest finite value). A NaN becomes 0x7fff,
// the canonical NaN of both formats on the device.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cnr_emu {

enum class Rounding { kNearestEven, kDown, kUp, kTowardZero };

// A 16-bit IEEE-style format: sign, kExpBits exponent bits, kMantBits stored significand bits.
template <int kExpBits, int kMantBits>
struct Narrow {
  static constexpr int kEmin = 2 - (1 << (kExpBits - 1));  // exponent of the smallest normal
  static constexpr uint32_t kInf = ((1u << kExpBits) - 1) << kMantBits;
  static constexpr uint16_t kCanonicalNaN = 0x7fff;

  static uint16_t from_float(float f, Rounding mode) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag > 0x7f800000u) return kCanonicalNaN;
    if (mag == 0x7f800000u) return static_cast<uint16_t>(sign | kInf);
    if (mag == 0) return static_cast<uint16_t>(sign);
    // |f| = m * 2^e exactly, m of at most 24 bits.
    const bool normal = (mag >> 23) != 0;
    const uint32_t m = normal ? (mag & 0x7fffffu) | 0x800000u : mag;
    const int e = normal ? static_cast<int>(mag >> 23) - 150 : -149;
    const int top = e + 31 - __builtin_clz(m);  // floor(log2 |f|)
    // The target's unit in the last place is 2^(exp - kMantBits); subnormals share kEmin.
    const int exp = top > kEmin ? top : kEmin;
    const int shift = exp - kMantBits - e;  // |f| / ulp = m / 2^shift
    uint32_t q;
    bool inexact = false, above_half = false, at_half = false;
    if (shift <= 0) {
      q = m << -shift;
    } else if (shift >= 32) {  // below half an ulp (m < 2^24 <= 2^(shift - 1))
      q = 0;
      inexact = true;
    } else {
      q = m >> shift;
      const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
      inexact = rest != 0;
      above_half = rest > half;
      at_half = rest == half;
    }
    // The rounding of the magnitude: away from zero, or not.
    const bool negative = sign != 0;
    bool away;
    switch (mode) {
      case Rounding::kNearestEven: away = above_half || (at_half && (q & 1u)); break;
      case Rounding::kDown: away = negative && inexact; break;
      case Rounding::kUp: away = !negative && inexact; break;
      default: away = false; break;
    }
    // The exponent field grows by one when q carries past the significand: the
    // sum stays right at the normal/subnormal boundary and into infinity.
    uint32_t bits = (static_cast<uint32_t>(exp - kEmin) << kMantBits) + q + (away ? 1u : 0u);
    if (bits >= kInf) {
      const bool to_inf = mode == Rounding::kNearestEven || (mode == Rounding::kUp && !negative) ||
                          (mode == Rounding::kDown && negative);
      bits = to_inf ? kInf : kInf - 1;
    }
    return static_cast<uint16_t>(sign | bits);
  }

  // Exact: every value of the format is a float32.
  static float to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t field = (h >> kMantBits) & ((1u << kExpBits) - 1), mant = h & ((1u << kMantBits) - 1);
    uint32_t x;
    if (field == (1u << kExpBits) - 1) {
      x = sign | 0x7f800000u | (mant << (23 - kMantBits));  // inf, or NaN with its payload
    } else if (field == 0 && mant == 0) {
      x = sign;
    } else if (field == 0) {  // subnormal: mant * 2^(kEmin - kMantBits), exact in float32 (maybe subnormal there)
      const float v = std::ldexp(static_cast<float>(mant), kEmin - kMantBits);
      std::memcpy(&x, &v, sizeof x);
      x |= sign;
    } else {
      const int exp = static_cast<int>(field) - 1 + kEmin;
      x = sign | (static_cast<uint32_t>(exp + 127) << 23) | (mant << (23 - kMantBits));
    }
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
  }
};

using Binary16 = Narrow<5, 10>;
using BFloat16 = Narrow<8, 7>;

// A device value of a 16-bit format, as CUDA's __half and __nv_bfloat16 are: its bits,
// converted from float (implicitly: to nearest even) and to float.
template <typename Format>
struct Value16 {
  unsigned short __x;  // the bits, as CUDA names them
  Value16() = default;
  Value16(float f) : __x(Format::from_float(f, Rounding::kNearestEven)) {}  // NOLINT: implicit, as in CUDA
  operator float() const { return Format::to_float(__x); }                  // NOLINT: as in CUDA

  static Value16 from_bits(unsigned short bits) {
    Value16 v;
    v.__x = bits;
    return v;
  }
  static Value16 rounded(float f, Rounding mode) { return from_bits(Format::from_float(f, mode)); }
  // -1 for -inf, 1 for +inf, else 0 (CUDA's __hisinf).
  int infinity() const { return __x == Format::kInf ? 1 : (__x == (0x8000u | Format::kInf) ? -1 : 0); }
  bool nan() const { return (__x & 0x7fffu) > Format::kInf; }
};

}  // namespace cnr_emu
