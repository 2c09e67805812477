// CPU kernels of the row codecs that stream each row once: bit packing, the
// float casts (none / fp16 / bf16) and uniform (a)symmetric quantization. Their
// decoders live in codecs_decode.cpp, the searches in codecs_search.cpp, k-means
// in codecs_kmeans.cpp. Every kernel handles one row at a time, so rows split over
// threads freely and the bytes never depend on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "codecs_common.h"

namespace cnr::codecs {
namespace {

struct RowRange {
  float mn, mx;
  bool bad;  // a NaN or an Inf
};

template <typename V>
CNR_INLINE RowRange row_range(const float* x, int64_t dim) {
  constexpr int W = width_of<V>;
  V mn = splat<V>(std::numeric_limits<float>::infinity()), mx = -mn;
  IntVec<V> bad{};
  int64_t j = 0;
  for (; j + W <= dim; j += W) {
    const V v = vload<V>(x + j);
    mn = vmin(mn, v);
    mx = vmax(mx, v);
    bad |= nonfinite_v(v);
  }
  if (j < dim) {
    const V v = vload_part<V>(x + j, dim - j, x[0]);
    mn = vmin(mn, v);
    mx = vmax(mx, v);
    bad |= nonfinite_v(v);
  }
  RowRange r{mn[0], mx[0], false};
  for (int l = 0; l < W; ++l) {
    r.mn = std::min(r.mn, mn[l]);
    r.mx = std::max(r.mx, mx[l]);
    r.bad |= bad[l] != 0;
  }
  return r;
}

// True when every |x| is 0 or `amax`: then step = amax reproduces the row exactly.
// As 0 <= |x| <= amax, another magnitude shows as min(|x|, amax - |x|) > 0; the
// test stays in float lanes because GCC lowers combined compare masks of wide
// vectors lane by lane.
template <typename V>
CNR_INLINE bool two_magnitudes(const float* x, int64_t dim, float amax) {
  constexpr int W = width_of<V>;
  V other{};
  int64_t j = 0;
  for (; j + W <= dim; j += W) {
    const V a = vmax(vload<V>(x + j), -vload<V>(x + j));
    other = vmax(other, vmin(a, amax - a));
  }
  if (j < dim) {
    const V v = vload_part<V>(x + j, dim - j, 0.0f);
    const V a = vmax(v, -v);
    other = vmax(other, vmin(a, amax - a));
  }
  for (int l = 0; l < W; ++l) {
    if (other[l] > 0.0f) return false;
  }
  return true;
}

// Smallest stored step (in `dtype`) whose grid reaches `span` = qmax * step.
template <int W>
CNR_INLINE float covering_scale(float span, int qmax, at::ScalarType dtype) {
  float s = round_param_w<W>(span / static_cast<float>(qmax), dtype, +1);
  while (std::isfinite(s) && s * static_cast<float>(qmax) < span) {
    // s >= 0, so the next value up is one unit in the last place more.
    if (dtype == at::kFloat) {
      uint32_t bits;
      std::memcpy(&bits, &s, sizeof s);
      ++bits;
      std::memcpy(&s, &bits, sizeof s);
    } else {
      s = half_to_float(static_cast<uint16_t>(half_bits_w<W>(s) + 1));
    }
  }
  return s;
}

// Codes of one row on the grid lo + step * q, q in [qmin, qmax] (stored as q - qmin).
template <typename V>
CNR_INLINE void quantize_row(const float* x, int64_t dim, float lo, float step, float qmin, float qmax,
                             uint8_t* codes) {
  constexpr int W = width_of<V>;
  const V inv = safe_inverse(splat<V>(step));
  const V vlo = splat<V>(lo), vqmin = splat<V>(qmin), vqmax = splat<V>(qmax);
  int64_t j = 0;
  for (; j + W <= dim; j += W) {
    const V q = vround(vclamp((vload<V>(x + j) - vlo) * inv, vqmin, vqmax));
    store_codes(codes + j, q - vqmin, W);
  }
  if (j < dim) {
    const V q = vround(vclamp((vload_part<V>(x + j, dim - j, lo) - vlo) * inv, vqmin, vqmax));
    store_codes(codes + j, q - vqmin, dim - j);
  }
}

at::Tensor pack_bits_cpu(const at::Tensor& codes, int64_t bits) {
  const auto c = checked_codes(codes, bits);
  const int64_t n = c.size(0), dim = c.size(1), nb = packed_bytes(dim, bits);
  if (c.numel() > 0) check_largest_code(c.max().item<uint8_t>(), bits);
  auto out = at::empty({n, nb}, c.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, row_grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) pack_row(src + r * dim, dim, bits, dst + r * nb);
  });
  return out;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed, int64_t bits, int64_t dim) {
  const auto p = checked_payload(packed, bits, dim, "unpack_bits", "packed");
  const int64_t n = p.size(0), nb = packed_bytes(dim, bits);
  auto out = at::empty({n, dim}, p.options());
  const uint8_t* src = p.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, row_grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) unpack_row(src + r * nb, dim, bits, dst + r * dim);
  });
  return out;
}

// none / fp16 / bf16: the row's bytes in the target dtype, plus the status of
// each row (a non-finite value, or a finite value that the dtype cannot hold).
struct CastArgs {
  const float* rows;
  int64_t dim;
  at::ScalarType dtype;
  uint8_t* payload;
  uint8_t* status;
};

template <int W>
void cast_rows_range(const CastArgs& a, int64_t r0, int64_t r1) {
  using V = typename Lanes<W>::f;
  const int64_t dim = a.dim;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = a.rows + r * dim;
    uint8_t flags = row_range<V>(xr, dim).bad ? kNonFinite : 0;
    if (a.dtype == at::kFloat) {
      std::memcpy(a.payload + r * dim * 4, xr, dim * 4);
    } else {
      auto* out = reinterpret_cast<uint16_t*>(a.payload + r * dim * 2);
      const bool half = a.dtype == at::kHalf;
      const uint16_t exp_mask = half ? 0x7c00 : 0x7f80;
      bool inf = false;
      for (int64_t j = 0; j < dim; ++j) {
        out[j] = half ? half_bits_w<W>(xr[j]) : c10::BFloat16(xr[j]).x;
        inf |= (out[j] & exp_mask) == exp_mask;
      }
      if (inf && !flags) flags = kOverflow;
    }
    const int64_t row_bytes = dim * (a.dtype == at::kFloat ? 4 : 2);
    if (flags) std::memset(a.payload + r * row_bytes, 0, row_bytes);  // a flagged row is zeroed
    a.status[r] = flags;
  }
}
CNR_LANE_VARIANTS(cast_rows_range, (const CastArgs& a, int64_t r0, int64_t r1), (a, r0, r1))

std::tuple<at::Tensor, at::Tensor> cast_rows_cpu(const at::Tensor& rows, at::ScalarType dtype) {
  const auto x = checked_rows(rows, "cast_rows");
  check_cast_dtype(dtype);
  const int64_t n = x.size(0), dim = x.size(1), width = static_cast<int64_t>(c10::elementSize(dtype));
  auto payload = at::empty({n, dim * width}, x.options().dtype(at::kByte));
  auto status = at::empty({n}, x.options().dtype(at::kByte));
  const CastArgs a{x.data_ptr<float>(), dim, dtype, payload.data_ptr<uint8_t>(), status.data_ptr<uint8_t>()};
  at::parallel_for(0, n, row_grain(dim),
                   [&](int64_t r0, int64_t r1) { CNR_LANE_DISPATCH(cast_rows_range, (a, r0, r1)); });
  return {payload, status};
}

struct UniformArgs {
  const float* rows;
  int64_t dim, bits, nb;
  int qmax;
  bool symmetric;
  at::ScalarType scale_dtype, bias_dtype;
  const float* grid_bias;  // null: the grid is [min, max]
  const float* grid_scale;
  uint8_t* payload;
  void* scale;
  void* bias;
  uint8_t* status;
};

template <int W>
void quantize_rows(const UniformArgs& a, int64_t r0, int64_t r1) {
  using V = typename Lanes<W>::f;
  const int64_t dim = a.dim, nb = a.nb;
  std::vector<uint8_t> codes(dim);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = a.rows + r * dim;
    const RowRange rr = row_range<V>(xr, dim);
    float lo = 0.0f, step = 0.0f;
    uint8_t flags = 0;
    if (rr.bad || (a.grid_bias && !(finite(a.grid_bias[r]) && finite(a.grid_scale[r]) && a.grid_scale[r] >= 0.0f))) {
      flags = kNonFinite;
    } else if (a.symmetric) {
      const float amax = std::max(-rr.mn, rr.mx) + 0.0f;  // + 0: a zero row's scale is +0 on every backend
      step = two_magnitudes<V>(xr, dim, amax) ? round_param_w<W>(amax, a.scale_dtype, +1)
                                              : covering_scale<W>(amax, a.qmax, a.scale_dtype);
    } else if (a.grid_bias) {
      lo = round_param_w<W>(a.grid_bias[r], a.bias_dtype, -1);
      step = round_param_w<W>(a.grid_scale[r], a.scale_dtype, +1);
    } else {
      lo = round_param_w<W>(rr.mn, a.bias_dtype, -1);
      step = covering_scale<W>(rr.mx - lo, a.qmax, a.scale_dtype);
    }
    if (!flags && !(finite(lo) && finite(step))) flags = kOverflow;
    a.status[r] = flags;
    if (flags) {  // the caller raises; keep the output deterministic anyway
      std::memset(a.payload + r * nb, 0, nb);
      lo = step = 0.0f;
    } else {
      const float qmin = a.symmetric ? static_cast<float>(-a.qmax) : 0.0f;
      quantize_row<V>(xr, dim, lo, step, qmin, static_cast<float>(a.qmax), codes.data());
      pack_row(codes.data(), dim, a.bits, a.payload + r * nb);
    }
    store_param_w<W>(a.scale, r, step, a.scale_dtype);
    if (!a.symmetric) store_param_w<W>(a.bias, r, lo, a.bias_dtype);
  }
}
CNR_LANE_VARIANTS(quantize_rows, (const UniformArgs& a, int64_t r0, int64_t r1), (a, r0, r1))

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_uniform_cpu(
    const at::Tensor& rows, int64_t bits, bool symmetric, at::ScalarType scale_dtype, at::ScalarType bias_dtype,
    const std::optional<at::Tensor>& grid_bias, const std::optional<at::Tensor>& grid_scale) {
  const auto x = checked_rows(rows, "quantize_uniform");
  check_bits(bits, "quantize_uniform");
  check_param_dtype(scale_dtype, "scale_dtype", "quantize_uniform");
  check_param_dtype(bias_dtype, "bias_dtype", "quantize_uniform");
  const int64_t n = x.size(0), dim = x.size(1), nb = packed_bytes(dim, bits);
  const auto [gb, gs] = checked_grid(grid_bias, grid_scale, x, symmetric, "quantize_uniform");
  auto payload = at::empty({n, nb}, x.options().dtype(at::kByte));
  auto scale = at::empty({n}, x.options().dtype(scale_dtype));
  auto bias = at::empty({symmetric ? 0 : n}, x.options().dtype(bias_dtype));
  auto status = at::empty({n}, x.options().dtype(at::kByte));
  UniformArgs a{};
  a.rows = x.data_ptr<float>();
  a.dim = dim;
  a.bits = bits;
  a.nb = nb;
  a.qmax = symmetric ? (1 << (bits - 1)) - 1 : (1 << bits) - 1;
  a.symmetric = symmetric;
  a.scale_dtype = scale_dtype;
  a.bias_dtype = bias_dtype;
  a.grid_bias = grid_bias ? gb.data_ptr<float>() : nullptr;
  a.grid_scale = grid_bias ? gs.data_ptr<float>() : nullptr;
  a.payload = payload.data_ptr<uint8_t>();
  a.scale = scale.data_ptr();
  a.bias = bias.data_ptr();
  a.status = status.data_ptr<uint8_t>();
  at::parallel_for(0, n, row_grain(dim),
                   [&](int64_t r0, int64_t r1) { CNR_LANE_DISPATCH(quantize_rows, (a, r0, r1)); });
  return {payload, scale, bias, status};
}

}  // namespace
}  // namespace cnr::codecs

TORCH_LIBRARY_IMPL(cnr, CPU, m) {
  m.impl("pack_bits", &cnr::codecs::pack_bits_cpu);
  m.impl("unpack_bits", &cnr::codecs::unpack_bits_cpu);
  m.impl("cast_rows", &cnr::codecs::cast_rows_cpu);
  m.impl("quantize_uniform", &cnr::codecs::quantize_uniform_cpu);
}
