// Helpers shared by the CPU row-codec kernels (codecs.cpp, codecs_search.cpp,
// codecs_kmeans.cpp): rounding of per-row parameters to their
// storage dtype, bit packing, lane vector types, and the per-ISA variants of
// the kernels (SSE4.2 / AVX2 / AVX-512, picked at run time).
//
// Determinism: every kernel treats each row on its own, and every sum over a row
// runs in one fixed order, so the bytes depend neither on the thread count nor
// on the vector width.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "../codecs_checks.h"

namespace cnr::codecs {

// Per-row status bits written by the encoders.
constexpr uint8_t kNonFinite = 1;  // the row holds a NaN or an Inf
constexpr uint8_t kOverflow = 2;   // a parameter (or value) does not fit its storage dtype

// Rows per parallel task: about 16 KiB of input each, so small tables stay serial.
inline int64_t row_grain(int64_t dim) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1)); }

// ---- per-row parameters --------------------------------------------------------

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// The float16 neighbour of `h` toward +inf (dir > 0) or -inf (dir < 0).
inline uint16_t half_step(uint16_t h, int dir) {
  const bool neg = h & 0x8000;
  if ((h & 0x7fff) == 0) return dir > 0 ? 0x0001 : 0x8001;  // +-0 -> smallest subnormal
  return (neg == (dir < 0)) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}

// Rounds `v` to a value of `dtype` (float32 or float16): to nearest (dir 0), up
// (dir > 0) or down (dir < 0). Rounding the scale up and the bias down keeps the
// requested range inside the stored grid, so values there stay within scale / 2.
// Returns the rounded value as float; inf marks an overflow.
inline float round_param(float v, at::ScalarType dtype, int dir, uint16_t* half_bits = nullptr) {
  if (dtype == at::kFloat) return v;
  uint16_t h = c10::Half(v).x;
  const float hv = half_to_float(h);
  if ((dir > 0 && hv < v) || (dir < 0 && hv > v)) h = half_step(h, dir);
  if (half_bits) *half_bits = h;
  return half_to_float(h);
}

// Writes the already rounded value `v` at `out[i]` of a float32 or float16 tensor.
inline void store_param(void* out, int64_t i, float v, at::ScalarType dtype) {
  if (dtype == at::kFloat) {
    static_cast<float*>(out)[i] = v;
  } else {
    static_cast<uint16_t*>(out)[i] = c10::Half(v).x;  // exact: v is a float16 value
  }
}

inline float load_param(const void* in, int64_t i, at::ScalarType dtype) {
  return dtype == at::kFloat ? static_cast<const float*>(in)[i] : half_to_float(static_cast<const uint16_t*>(in)[i]);
}

inline bool finite(float v) { return std::abs(v) <= std::numeric_limits<float>::max(); }

// ---- bit packing -------------------------------------------------------------
// Eight b-bit codes make exactly b bytes, so a row packs group by group; the
// last group writes only the bytes the row needs. Matches FBGEMM's layout for
// 2, 4 and 8 bits (first code in the low bits of the first byte).

// Eight codes, one per byte of `x` (little-endian), squeezed into the low 8 * B
// bits, and back: three shift-or-mask steps that merge (or split) neighbouring
// fields, pairs, then quads, with no per-code loop.
constexpr uint64_t lane_mask(int lane_bits, int keep) {
  uint64_t m = 0;
  for (int i = 0; i < 64; i += lane_bits) m |= ((uint64_t{1} << keep) - 1) << i;
  return m;
}
template <int B>
inline uint64_t squeeze8(uint64_t x) {
  if constexpr (B == 8) {
    return x;
  } else {  // in an else: a shift by 8 * B = 64 must not even be compiled
    x = (x | (x >> (8 - B))) & lane_mask(16, 2 * B);
    x = (x | (x >> (16 - 2 * B))) & lane_mask(32, 4 * B);
    return (x | (x >> (32 - 4 * B))) & ((uint64_t{1} << (8 * B)) - 1);
  }
}
template <int B>
inline uint64_t spread8(uint64_t x) {
  if constexpr (B == 8) {
    return x;
  } else {
    x = (x | (x << (32 - 4 * B))) & lane_mask(32, 4 * B);
    x = (x | (x << (16 - 2 * B))) & lane_mask(16, 2 * B);
    return (x | (x << (8 - B))) & lane_mask(8, B);
  }
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the packed layout assumes a little-endian host");

template <int B>
inline void pack_row(const uint8_t* codes, int64_t dim, uint8_t* out) {
  const int64_t full = dim / 8;
  for (int64_t g = 0; g < full; ++g) {
    uint64_t x;
    std::memcpy(&x, codes + g * 8, 8);
    const uint64_t w = squeeze8<B>(x);
    std::memcpy(out + g * B, &w, B);
  }
  if (const int64_t rest = dim - full * 8) {
    uint64_t x = 0;
    std::memcpy(&x, codes + full * 8, rest);
    const uint64_t w = squeeze8<B>(x);
    std::memcpy(out + full * B, &w, (rest * B + 7) / 8);
  }
}

template <int B>
inline void unpack_row(const uint8_t* in, int64_t dim, uint8_t* codes) {
  const int64_t full = dim / 8;
  for (int64_t g = 0; g < full; ++g) {
    uint64_t w = 0;
    std::memcpy(&w, in + g * B, B);
    const uint64_t x = spread8<B>(w);
    std::memcpy(codes + g * 8, &x, 8);
  }
  if (const int64_t rest = dim - full * 8) {
    uint64_t w = 0;
    std::memcpy(&w, in + full * B, (rest * B + 7) / 8);
    const uint64_t x = spread8<B>(w);
    std::memcpy(codes + full * 8, &x, rest);
  }
}

inline void pack_row(const uint8_t* codes, int64_t dim, int64_t bits, uint8_t* out) {
  switch (bits) {
    case 2: return pack_row<2>(codes, dim, out);
    case 3: return pack_row<3>(codes, dim, out);
    case 4: return pack_row<4>(codes, dim, out);
    default: return pack_row<8>(codes, dim, out);
  }
}

inline void unpack_row(const uint8_t* in, int64_t dim, int64_t bits, uint8_t* codes) {
  switch (bits) {
    case 2: return unpack_row<2>(in, dim, codes);
    case 3: return unpack_row<3>(in, dim, codes);
    case 4: return unpack_row<4>(in, dim, codes);
    default: return unpack_row<8>(in, dim, codes);
  }
}

// ---- lane vectors ---------------------------------------------------------------
// GCC/Clang vector extensions. Arithmetic on them is lane-wise IEEE float, and
// no kernel contracts a * b + c into an FMA (see CNR_LANE_VARIANTS), so results
// do not depend on the vector width or the ISA that runs them.

#define CNR_INLINE inline __attribute__((always_inline))
// Wide vectors only ever cross function boundaries inside one always-inlined,
// flattened kernel, so GCC's note that their calling convention differs by ISA
// does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

template <int W>
struct Lanes {
  typedef float f __attribute__((vector_size(W * sizeof(float))));
  typedef int32_t i __attribute__((vector_size(W * sizeof(int32_t))));
  typedef uint8_t u8 __attribute__((vector_size(W)));
  typedef uint32_t u32 __attribute__((vector_size(W * sizeof(uint32_t))));
};
template <typename V>
constexpr int width_of = static_cast<int>(sizeof(V) / sizeof(float));
template <typename V>
using IntVec = decltype(V{} < V{});
template <typename V>
using ByteVec = typename Lanes<width_of<V>>::u8;

template <typename V>
CNR_INLINE V vload(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
CNR_INLINE void vstore(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename V>
CNR_INLINE V splat(float s) {
  return V{} + s;
}
// Loads the n < width floats at p and pads the other lanes with `pad`.
template <typename V>
CNR_INLINE V vload_part(const float* p, int64_t n, float pad) {
  float t[width_of<V>];
  for (int l = 0; l < width_of<V>; ++l) t[l] = l < n ? p[l] : pad;
  return vload<V>(t);
}
template <typename V>
CNR_INLINE V vmin(V a, V b) {
  return a < b ? a : b;
}
template <typename V>
CNR_INLINE V vmax(V a, V b) {
  return a > b ? a : b;
}
template <typename V>
CNR_INLINE V vclamp(V v, V lo, V hi) {
  return vmin(vmax(v, lo), hi);
}
// Round half to even for |v| < 2^22 (codes are far below), like torch.round;
// two adds vectorise everywhere, nearbyint does not.
template <typename V>
CNR_INLINE V vround(V v) {
  const V magic = splat<V>(12582912.0f);  // 1.5 * 2^23
  return (v + magic) - magic;
}
// 1 / s, or 0 where s == 0 (a constant row: every value maps to code 0).
template <typename V>
CNR_INLINE V safe_inverse(V s) {
  return s > 0.0f ? 1.0f / s : splat<V>(0.0f);
}
template <typename V>
CNR_INLINE IntVec<V> nonfinite_v(V v) {
  const V a = v < 0.0f ? -v : v;
  return ~(a <= std::numeric_limits<float>::max());
}
// Stores the first n lanes of integral, in-range codes as bytes.
template <typename V>
CNR_INLINE void store_codes(uint8_t* dst, V q, int64_t n) {
  const auto c = __builtin_convertvector(__builtin_convertvector(q, IntVec<V>), ByteVec<V>);
  std::memcpy(dst, &c, n);
}
template <typename V>
CNR_INLINE V load_codes(const uint8_t* src, int64_t n) {
  ByteVec<V> c{};
  std::memcpy(&c, src, n);
  return __builtin_convertvector(c, V);
}

// Shuffle masks of one butterfly stage of a W x W transpose: within each block
// of 2S lanes, the low output takes the low S lanes of both inputs, the high
// output their high S lanes.
template <int W, int S, bool High>
constexpr typename Lanes<W>::i butterfly_mask() {
  typename Lanes<W>::i m{};
  for (int p = 0; p < W; ++p) {
    const int block = p / (2 * S) * (2 * S), t = p % (2 * S);
    m[p] = t < S ? block + t + (High ? S : 0) : W + block + t - S + (High ? S : 0);
  }
  return m;
}
template <int W, int S>
CNR_INLINE void butterfly(typename Lanes<W>::f* r) {
  if constexpr (S >= 1) {
    for (int i = 0; i < W; ++i) {
      if (i & S) continue;
      const auto a = r[i], b = r[i + S];
      r[i] = __builtin_shuffle(a, b, butterfly_mask<W, S, false>());
      r[i + S] = __builtin_shuffle(a, b, butterfly_mask<W, S, true>());
    }
    butterfly<W, S / 2>(r);
  }
}

// Copies rows [r0, r0 + n) of a [N, dim] matrix into a column-major block
// xt[j * W + l], so that one vector holds column j of W rows. Lanes past n
// repeat the last row; their results are discarded. W x W tiles transpose in
// log2(W) shuffle stages where the ISA has two-source shuffles (W >= 8).
template <int W>
CNR_INLINE void transpose_block(const float* rows, int64_t r0, int64_t n, int64_t dim, float* xt) {
  const float* src[W];
  for (int l = 0; l < W; ++l) src[l] = rows + (r0 + std::min<int64_t>(l, n - 1)) * dim;
  int64_t j = 0;
  if constexpr (W >= 8) {
    for (; j + W <= dim; j += W) {
      typename Lanes<W>::f t[W];
      for (int l = 0; l < W; ++l) std::memcpy(&t[l], src[l] + j, sizeof t[l]);
      butterfly<W, W / 2>(t);
      std::memcpy(xt + j * W, t, sizeof t);
    }
  }
  for (; j < dim; ++j) {
    for (int l = 0; l < W; ++l) xt[j * W + l] = src[l][j];
  }
}

// Packs the codes of a block held column-wise (column j of lanes 0..W-1 from
// code_of(j), a float vector of integral codes) into the rows out[l], l < cnt:
// per group of eight columns, shift-or the codes of all lanes at once, then
// store each lane's B bytes (a constant size, so no memcpy call).
template <typename V, int B, typename CodeOf>
CNR_INLINE void pack_lanes(int64_t dim, int64_t cnt, uint8_t* const* out, CodeOf& code_of) {
  using U = typename Lanes<width_of<V>>::u32;
  for (int64_t g = 0; g * 8 < dim; ++g) {
    const int64_t n = std::min<int64_t>(8, dim - g * 8);
    U lo{}, hi{};  // codes 0-3 and 4-7 of the group: 32 bits each even at 8 bits
    for (int64_t k = 0; k < n; ++k) {
      const U q = reinterpret_cast<U>(__builtin_convertvector(code_of(g * 8 + k), IntVec<V>));
      if (k < 4) {
        lo |= q << static_cast<uint32_t>(B * k);
      } else {
        hi |= q << static_cast<uint32_t>(B * (k - 4));
      }
    }
    for (int64_t l = 0; l < cnt; ++l) {
      const uint64_t w = lo[l] | (static_cast<uint64_t>(hi[l]) << (4 * B));
      if (n == 8) {
        std::memcpy(out[l] + g * B, &w, B);
      } else {
        std::memcpy(out[l] + g * B, &w, static_cast<size_t>((n * B + 7) / 8));
      }
    }
  }
}
template <typename V, typename CodeOf>
CNR_INLINE void pack_lanes(int64_t dim, int bits, int64_t cnt, uint8_t* const* out, CodeOf&& code_of) {
  switch (bits) {
    case 2: return pack_lanes<V, 2>(dim, cnt, out, code_of);
    case 3: return pack_lanes<V, 3>(dim, cnt, out, code_of);
    case 4: return pack_lanes<V, 4>(dim, cnt, out, code_of);
    default: return pack_lanes<V, 8>(dim, cnt, out, code_of);
  }
}

// The width the per-row kernels use: the build target's native vectors (GCC
// scalarises generic vectors wider than the target's registers).
#if defined(__AVX512F__)
constexpr int kBaseLanes = 16;
#elif defined(__AVX__)
constexpr int kBaseLanes = 8;
#else
constexpr int kBaseLanes = 4;
#endif
using vf = Lanes<kBaseLanes>::f;
using vi = Lanes<kBaseLanes>::i;

// x86 intrinsics, F16C conversions and the multi-ISA variants: on x86-64 only.
// CNR_NO_X86_INTRINSICS (the CNR_PORTABLE=1 build) makes an x86-64 build take
// the generic-vector path of every other CPU, so that path is built and tested
// here too; both paths give the same bits.
#if defined(__x86_64__) && !defined(CNR_NO_X86_INTRINSICS)
#define CNR_X86 1
#else
#define CNR_X86 0
#endif

// The blocked kernels (one row per lane) are compiled for several ISAs and
// picked at run time: the widest this CPU runs, capped by the environment
// variable CNR_CODEC_LANES (4, 8 or 16) so that tests can compare widths.
#if CNR_X86 && defined(__GNUC__) && !defined(__clang__)
#define CNR_MULTI_ISA 1
inline int lane_width() {
  static const int width = [] {
    __builtin_cpu_init();
    const bool f16c = __builtin_cpu_supports("f16c");
    int w = f16c && __builtin_cpu_supports("avx512f") ? 16 : f16c && __builtin_cpu_supports("avx2") ? 8 : 4;
    if (const char* cap = std::getenv("CNR_CODEC_LANES")) w = std::min(w, std::max(4, std::atoi(cap)));
    return w >= 16 ? 16 : w >= 8 ? 8 : 4;
  }();
  return width;
}
// Defines name##_16 / name##_8 / name##_4 running name<W>(args), each inlined
// whole (flatten) into code for its ISA, with FMA contraction off so that every
// width rounds identically.
#define CNR_LANE_VARIANTS(name, params, args)                                                                       \
  __attribute__((target("avx512f,f16c"), optimize("fp-contract=off"), flatten)) void name##_16 params {       \
    name<16> args;                                                                                              \
  }                                                                                                             \
  __attribute__((target("avx2,f16c"), optimize("fp-contract=off"), flatten)) void name##_8 params { name<8> args; } \
  __attribute__((optimize("fp-contract=off"), flatten)) void name##_4 params { name<4> args; }
#define CNR_LANE_DISPATCH(name, args) \
  (lane_width() == 16 ? name##_16 args : lane_width() == 8 ? name##_8 args : name##_4 args)
#include <immintrin.h>
// F16C conversions for the AVX2 / AVX-512 variants, whose targets include f16c
// (flatten inlines them there). IEEE rounding, like the software path.
__attribute__((target("f16c"))) inline float f16c_round(float v, int dir) {
  const uint16_t h = dir > 0   ? _cvtss_sh(v, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC)
                     : dir < 0 ? _cvtss_sh(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
                               : _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _cvtsh_ss(h);
}
__attribute__((target("f16c"))) inline uint16_t f16c_bits(float v) {
  return _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
__attribute__((target("f16c"))) inline float f16c_value(uint16_t h) { return _cvtsh_ss(h); }
#else
inline int lane_width() { return kBaseLanes; }
#define CNR_LANE_VARIANTS(name, params, args) \
  void name##_base params { name<kBaseLanes> args; }
#define CNR_LANE_DISPATCH(name, args) name##_base args
#endif

// round_param / store_param for kernels of lane width W: hardware float16
// conversion where the variant has it, the same values either way.
template <int W>
CNR_INLINE float round_param_w(float v, at::ScalarType dtype, int dir) {
#if CNR_MULTI_ISA
  if constexpr (W >= 8) return dtype == at::kFloat ? v : f16c_round(v, dir);
#endif
  return round_param(v, dtype, dir);
}
template <int W>
CNR_INLINE float load_param_w(const void* in, int64_t i, at::ScalarType dtype) {
  if (dtype == at::kFloat) return static_cast<const float*>(in)[i];
#if CNR_MULTI_ISA
  if constexpr (W >= 8) return f16c_value(static_cast<const uint16_t*>(in)[i]);
#endif
  return half_to_float(static_cast<const uint16_t*>(in)[i]);
}
template <int W>
CNR_INLINE uint16_t half_bits_w(float v) {
#if CNR_MULTI_ISA
  if constexpr (W >= 8) return f16c_bits(v);
#endif
  return c10::Half(v).x;
}
template <int W>
CNR_INLINE void store_param_w(void* out, int64_t i, float v, at::ScalarType dtype) {
  if (dtype == at::kHalf) {
    static_cast<uint16_t*>(out)[i] = half_bits_w<W>(v);  // exact: v is a float16 value
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

}  // namespace cnr::codecs
