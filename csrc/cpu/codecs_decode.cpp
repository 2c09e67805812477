// CPU decoders of the row codecs: uniform (a)symmetric codes back to float32,
// into a new tensor or straight into given rows of a live one (restore's path),
// and codebook (k-means) codes. Codes are unpacked into vector lanes block by
// block; large outputs are written with streaming stores. Every kernel handles
// one row at a time, so the values never depend on the thread count or ISA.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "codecs_common.h"

#if CNR_X86
#include <immintrin.h>
#endif

namespace cnr::codecs {
namespace {

struct DequantArgs {
  const uint8_t* payload;
  int64_t dim, bits, nb;
  const void* scale;
  const void* bias;  // null: symmetric codes, stored shifted by qmax
  at::ScalarType scale_dtype, bias_dtype;
  float* out;
  const int64_t* rows = nullptr;  // dequantize_uniform_into_: row r goes to out row rows[r] (< 0: skipped)
  int64_t out_stride = 0;         // floats between out rows; 0: dim
  bool stream = false;            // rows start on a cache line and fill whole lines: store them non-temporally
  bool accumulate = false;        // add each decoded row onto its destination instead of writing it
};

// ---- decoding ----------------------------------------------------------------
// dequantize_rows decodes a block of codes straight from the packed bytes into
// float lanes (no codes buffer) and computes lo + step * (code - shift) on them,
// in that order and with no FMA at every width, so every ISA gives the same bits.

// Codes per block of the decoder: one vector of W lanes, and at least eight codes
// so that a block starts on a byte (W = 4 takes two vectors per block).
template <int W>
constexpr int block_codes_n = W < 8 ? 8 : W;

// A block of B < 8 bits and W >= 8 lanes is at most 64 bits. Where it fits 32 bits,
// lane l takes the broadcast word shifted by B * l; otherwise lanes 0-7 take the
// first eight codes' B bytes and lanes 8-15 the next B bytes (a word each, even at
// 3 bits), shifted by B * (l % 8).
template <int W, int B>
constexpr typename Lanes<W>::u32 code_shift() {
  typename Lanes<W>::u32 m{};
  for (int l = 0; l < W; ++l) m[l] = static_cast<uint32_t>(W * B <= 32 ? B * l : B * (l % 8));
  return m;
}
template <int W>
constexpr typename Lanes<W>::i second_group() {  // two-source shuffle: lane W is the second word
  typename Lanes<W>::i m{};
  for (int l = 0; l < W; ++l) m[l] = l < 8 ? 0 : W;
  return m;
}

template <typename V>
CNR_INLINE V int_to_float(typename Lanes<width_of<V>>::u32 u) {
  return __builtin_convertvector(reinterpret_cast<IntVec<V>>(u), V);
}

// W bytes at p as floats. GCC converts generic byte vectors lane by lane, so x86
// widens them with (v)pmovzxbd where it can.
#if CNR_MULTI_ISA
__attribute__((target("avx512f"))) inline __m512i widen_bytes16(const uint8_t* p) {
  // maskz: the unmasked form trips GCC 12's -Wmaybe-uninitialized
  return _mm512_maskz_cvtepu8_epi32(0xffff, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx2"))) inline __m256 widen_bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif
#if CNR_X86 && defined(__SSE4_1__)
inline __m128 widen_bytes4(uint32_t x) { return _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(x)))); }
#endif
template <typename V>
CNR_INLINE V bytes_to_float(const uint8_t* p) {
  constexpr int W = width_of<V>;
#if CNR_MULTI_ISA
  if constexpr (W == 16) return __builtin_convertvector(reinterpret_cast<IntVec<V>>(widen_bytes16(p)), V);
  if constexpr (W == 8) return reinterpret_cast<V>(widen_bytes8(p));
#endif
#if CNR_X86 && defined(__SSE4_1__)
  if constexpr (W == 4) {
    uint32_t x;
    std::memcpy(&x, p, 4);
    return reinterpret_cast<V>(widen_bytes4(x));
  }
#endif
  ByteVec<V> b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, IntVec<V>), V);
}

// The codes of one block (block_codes_n<W> codes in as many times B / 8 bytes at
// `in`) as float vectors c[0 .. K / W), with no per-code loop and no buffer.
template <typename V, int B>
CNR_INLINE void block_codes(const uint8_t* in, V* c) {
  constexpr int W = width_of<V>, K = block_codes_n<W>;
  if constexpr (B == 8) {
    for (int v = 0; v < K / W; ++v) c[v] = bytes_to_float<V>(in + v * W);
  } else if constexpr (W >= 8) {
    using U = typename Lanes<W>::u32;
    uint64_t w = 0;  // K * B <= 64 bits
    std::memcpy(&w, in, K * B / 8);
    // Broadcasts merged by a constant shuffle: inserting into a wider vector
    // would round-trip through memory.
    U words = U{} + static_cast<uint32_t>(w);
    if constexpr (K * B > 32) words = __builtin_shuffle(words, U{} + static_cast<uint32_t>(w >> (8 * B)), second_group<W>());
    c[0] = int_to_float<V>((words >> code_shift<W, B>()) & static_cast<uint32_t>((1 << B) - 1));
  } else {  // four lanes: spread the eight codes into eight bytes, then widen each half
    uint64_t w = 0;
    std::memcpy(&w, in, B);
    const uint64_t x = spread8<B>(w);
#if CNR_X86 && defined(__SSE4_1__)
    c[0] = reinterpret_cast<V>(widen_bytes4(static_cast<uint32_t>(x)));
    c[1] = reinterpret_cast<V>(widen_bytes4(static_cast<uint32_t>(x >> 32)));
#else
    uint8_t bytes[8];
    std::memcpy(bytes, &x, 8);
    c[0] = bytes_to_float<V>(bytes);
    c[1] = bytes_to_float<V>(bytes + 4);
#endif
  }
}

// Rows ahead whose destination the decoder prefetches: scattered rows of a large
// `out` miss the cache (5-10% faster at 10-25% random rows into 100 MB, when
// the rows are not streamed).
constexpr int64_t kPrefetchRows = 8;

// Prefetches (for writing) the first lines of a destination row.
CNR_INLINE void prefetch_row(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < std::min<int64_t>(bytes, 256); off += 64) __builtin_prefetch(c + off, 1, 3);
}

// Non-temporal stores of whole cache lines: into an `out` far larger than the
// cache they skip reading each line before it is overwritten (2x faster at 25%
// random rows into 100 MB). They leave the rows out of the cache, which costs
// more than it saves below a few tens of MB.
constexpr int64_t kStreamBytes = int64_t{32} << 20;
constexpr int64_t kLineBytes = 64;

#if CNR_MULTI_ISA
__attribute__((target("avx512f"))) inline void stream16(float* p, __m512 v) { _mm512_stream_ps(p, v); }
__attribute__((target("avx"))) inline void stream8(float* p, __m256 v) { _mm256_stream_ps(p, v); }
#endif
#if CNR_X86
inline void stream4(float* p, __m128 v) { _mm_stream_ps(p, v); }
#endif
// Stores v at p (aligned to the vector), bypassing the cache where the ISA can.
template <typename V>
CNR_INLINE void vstream(float* p, const V& v) {
  constexpr int W = width_of<V>;
#if CNR_MULTI_ISA
  if constexpr (W == 16) return stream16(p, reinterpret_cast<__m512>(v));
  if constexpr (W == 8) return stream8(p, reinterpret_cast<__m256>(v));
#endif
#if CNR_X86
  if constexpr (W == 4) return stream4(p, reinterpret_cast<__m128>(v));
#endif
  vstore(p, v);
}
inline void stream_fence() {
#if CNR_X86
  _mm_sfence();  // the streamed rows are visible to other threads from here on
#endif
}

template <int W, int B>
CNR_INLINE void dequantize_rows_b(const DequantArgs& a, int64_t r0, int64_t r1) {
  using V = typename Lanes<W>::f;
  constexpr int K = block_codes_n<W>, KB = K * B / 8;
  const int64_t dim = a.dim, nb = a.nb, full = dim / K * K;
  const V shift = splat<V>(a.bias ? 0.0f : static_cast<float>((1 << (B - 1)) - 1));
  const int64_t stride = a.out_stride ? a.out_stride : dim;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(float));
  const bool stream = a.stream;  // whole lines: then dim is a multiple of K, and no row has a tail
  const bool prefetch = a.rows && !stream;  // a streamed line must not be fetched
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t dst = a.rows ? a.rows[r] : r;
    if (prefetch && r + kPrefetchRows < r1) {
      const int64_t ahead = a.rows[r + kPrefetchRows];
      if (ahead >= 0) prefetch_row(a.out + ahead * stride, row_bytes);
    }
    if (dst < 0) continue;
    const uint8_t* in = a.payload + r * nb;
    const V step = splat<V>(load_param_w<W>(a.scale, r, a.scale_dtype));
    const V lo = splat<V>(a.bias ? load_param_w<W>(a.bias, r, a.bias_dtype) : 0.0f);
    float* out_r = a.out + dst * stride;
    int64_t j = 0;
    for (; j < full; j += K, in += KB) {
      V c[K / W];
      block_codes<V, B>(in, c);
      if (stream) {
        for (int v = 0; v < K / W; ++v) vstream(out_r + j + v * W, lo + step * (c[v] - shift));
      } else if (a.accumulate) {  // the decoded value first, then one rounded add: decode-then-add's bits
        for (int v = 0; v < K / W; ++v) {
          const V x = lo + step * (c[v] - shift);
          vstore(out_r + j + v * W, vload<V>(out_r + j + v * W) + x);
        }
      } else {
        for (int v = 0; v < K / W; ++v) vstore(out_r + j + v * W, lo + step * (c[v] - shift));
      }
    }
    if (j < dim) {  // the last codes: their bytes, zero-padded to a block
      uint8_t tail[KB] = {};
      std::memcpy(tail, in, static_cast<size_t>(packed_bytes(dim - j, B)));
      V c[K / W];
      block_codes<V, B>(tail, c);
      float t[K];
      for (int v = 0; v < K / W; ++v) vstore(t + v * W, lo + step * (c[v] - shift));
      if (a.accumulate) {
        for (int64_t l = 0; l < dim - j; ++l) out_r[j + l] += t[l];
      } else {
        std::memcpy(out_r + j, t, (dim - j) * sizeof(float));
      }
    }
  }
  if (stream) stream_fence();
}

template <int W>
void dequantize_rows(const DequantArgs& a, int64_t r0, int64_t r1) {
  switch (a.bits) {
    case 2: return dequantize_rows_b<W, 2>(a, r0, r1);
    case 3: return dequantize_rows_b<W, 3>(a, r0, r1);
    case 4: return dequantize_rows_b<W, 4>(a, r0, r1);
    default: return dequantize_rows_b<W, 8>(a, r0, r1);
  }
}
CNR_LANE_VARIANTS(dequantize_rows, (const DequantArgs& a, int64_t r0, int64_t r1), (a, r0, r1))

// The inputs of a uniform decode, checked and made contiguous; args() points into them.
struct UniformInputs {
  at::Tensor payload, scale, bias;  // bias undefined: symmetric codes
  int64_t n, dim, bits, nb;

  DequantArgs args(float* out) const {
    return DequantArgs{payload.data_ptr<uint8_t>(),
                       dim,
                       bits,
                       nb,
                       scale.data_ptr(),
                       bias.defined() ? bias.data_ptr() : nullptr,
                       scale.scalar_type(),
                       bias.defined() ? bias.scalar_type() : at::kFloat,
                       out};
  }
};

UniformInputs uniform_inputs(const at::Tensor& payload, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                             int64_t bits, int64_t dim, const char* op) {
  const auto p = checked_payload(payload, bits, dim, op);
  const int64_t n = p.size(0);
  return UniformInputs{p, checked_params(scale, n, p, "scale", op),
                       bias ? checked_params(*bias, n, p, "bias", op) : at::Tensor(), n, dim, bits,
                       packed_bytes(dim, bits)};
}

at::Tensor dequantize_uniform_cpu(const at::Tensor& payload, const at::Tensor& scale,
                                  const std::optional<at::Tensor>& bias, int64_t bits, int64_t dim) {
  const auto in = uniform_inputs(payload, scale, bias, bits, dim, "dequantize_uniform");
  auto out = at::empty({in.n, dim}, payload.options().dtype(at::kFloat));
  const DequantArgs a = in.args(out.data_ptr<float>());
  at::parallel_for(0, in.n, row_grain(dim),
                   [&](int64_t r0, int64_t r1) { CNR_LANE_DISPATCH(dequantize_rows, (a, r0, r1)); });
  return out;
}

// Decodes row r straight into out[rows[r]] (rows[r] < 0: skipped), or adds it
// there (accumulate: a residual chain): restore's path, with no gather of the
// needed rows and no float32 temporary to scatter or add.
void dequantize_uniform_into_cpu(const at::Tensor& payload, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& bias, int64_t bits, const at::Tensor& rows,
                                 const at::Tensor& out, bool accumulate) {
  check_bits(bits, "dequantize_uniform_into_");
  check_into_out(out);
  const int64_t dim = out.size(1);
  const auto in = uniform_inputs(payload, scale, bias, bits, dim, "dequantize_uniform_into_");
  const int64_t n = in.n;
  check_into_rows(rows, n);
  const auto idx = rows.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t out_rows = out.size(0);
  check_destinations(ip, n, out_rows, "dequantize_uniform_into_", "row");
  if (accumulate) check_distinct_destinations(ip, n, out_rows, "dequantize_uniform_into_");
  if (n == 0 || dim == 0) return;
  DequantArgs a = in.args(out.data_ptr<float>());
  a.rows = ip;
  a.out_stride = out.stride(0);
  a.accumulate = accumulate;
  const int64_t line = kLineBytes / static_cast<int64_t>(sizeof(float));
  a.stream = !accumulate && out_rows * a.out_stride * static_cast<int64_t>(sizeof(float)) >= kStreamBytes &&
             reinterpret_cast<uintptr_t>(a.out) % kLineBytes == 0 && a.out_stride % line == 0 && dim % line == 0;
  at::parallel_for(0, n, row_grain(dim),
                   [&](int64_t r0, int64_t r1) { CNR_LANE_DISPATCH(dequantize_rows, (a, r0, r1)); });
}

struct CodebookArgs {
  const uint8_t* payload;
  int64_t dim, bits, nb;
  const float* bias;
  const void* codebook;
  at::ScalarType codebook_dtype;
  int64_t k1;  // codebook entries per row (K - 1)
  float* out;
  std::atomic<bool>* bad_code;
};

template <int W>
void dequantize_codebook_rows(const CodebookArgs& a, int64_t r0, int64_t r1) {
  std::vector<uint8_t> codes(a.dim);
  float lut[256];
  for (int64_t r = r0; r < r1; ++r) {
    lut[0] = a.bias[r];
    for (int64_t k = 1; k <= a.k1; ++k) {
      lut[k] = a.bias[r] + load_param_w<W>(a.codebook, r * a.k1 + k - 1, a.codebook_dtype);
    }
    unpack_row(a.payload + r * a.nb, a.dim, a.bits, codes.data());
    uint8_t top = 0;
    float* out_r = a.out + r * a.dim;
    for (int64_t j = 0; j < a.dim; ++j) {
      top = std::max(top, codes[j]);
      out_r[j] = lut[std::min<int64_t>(codes[j], a.k1)];  // clamped: a corrupt code must not read past the table
    }
    if (top > a.k1) *a.bad_code = true;
  }
}
CNR_LANE_VARIANTS(dequantize_codebook_rows, (const CodebookArgs& a, int64_t r0, int64_t r1), (a, r0, r1))

at::Tensor dequantize_codebook_cpu(const at::Tensor& payload, const at::Tensor& bias, const at::Tensor& codebook,
                                   int64_t bits, int64_t dim) {
  const auto p = checked_payload(payload, bits, dim, "dequantize_codebook");
  check_codebook(p, bias, codebook, bits);
  const int64_t n = p.size(0), nb = packed_bytes(dim, bits);
  const auto b = bias.contiguous();
  const auto cb = codebook.contiguous();
  auto out = at::empty({n, dim}, payload.options().dtype(at::kFloat));
  std::atomic<bool> bad_code{false};
  const CodebookArgs a{p.data_ptr<uint8_t>(), dim,          bits, nb, b.data_ptr<float>(), cb.data_ptr(),
                       cb.scalar_type(),      cb.size(1), out.data_ptr<float>(), &bad_code};
  at::parallel_for(0, n, row_grain(dim),
                   [&](int64_t r0, int64_t r1) { CNR_LANE_DISPATCH(dequantize_codebook_rows, (a, r0, r1)); });
  check_codes_in_codebook(bad_code, a.k1);
  return out;
}

}  // namespace
}  // namespace cnr::codecs

TORCH_LIBRARY_IMPL(cnr, CPU, m) {
  m.impl("dequantize_uniform", &cnr::codecs::dequantize_uniform_cpu);
  m.impl("dequantize_uniform_into_", &cnr::codecs::dequantize_uniform_into_cpu);
  m.impl("dequantize_codebook", &cnr::codecs::dequantize_codebook_cpu);
}
