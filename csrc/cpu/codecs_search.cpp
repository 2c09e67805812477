// CPU kernels of the clipping-range searches for asymmetric quantization.
//
// adaptive_search: the greedy search of Check-N-Run. Start at [min, max] with
// step = range / num_bins; each round try moving min up or max down by one step,
// take the move with the lower squared error, remember the best range; stop once
// the range falls below ratio * (max - min). Then `refit_iters` least-squares
// refits of (bias, scale) to the codes of the best grid (a Lloyd step restricted
// to uniform grids; each one can only lower the error).
//
// exhaustive_search: every range on a grid of `grid` steps, for measurements.
//
// Each candidate's error is exact: the row is re-quantized. That is cheap here
// because W rows (4, 8 or 16 by ISA) run side by side, one per vector lane of a
// transposed block, so a candidate costs about nine vector ops per column, with
// no horizontal sums and no branches, and every lane takes its own decisions by
// blending. Sorting each row and evaluating candidates exactly from prefix sums
// per quantization bin measured far slower for D = 64..1024 (the sort and the
// bin searches dominate), and the cheap uniform-noise estimate of the in-range
// error steered the search to ranges 8-20% worse; see CODECS_NOTES.md.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "codecs_common.h"

namespace cnr::codecs {
namespace {

// Lane-wise squared error of quantizing the block on the grids (lo1, s1) and
// (lo2, s2), measured in steps (times s^2 gives x units): t = (x - lo) / s,
// r = t - round(clamp(t, 0, qmax)). Values below lo (above hi) fall on code 0
// (qmax), so clipping is counted with the rounding.
template <typename V>
CNR_INLINE void grid_error2(const float* xt, int64_t dim, V lo1, V s1, V lo2, V s2, V qmax, V* e1, V* e2) {
  constexpr int W = width_of<V>;
  const V inv1 = safe_inverse(s1), inv2 = safe_inverse(s2), zero = splat<V>(0.0f);
  V a1{}, a2{};
  for (int64_t j = 0; j < dim; ++j) {
    const V x = vload<V>(xt + j * W);
    const V t1 = (x - lo1) * inv1, t2 = (x - lo2) * inv2;
    const V r1 = t1 - vround(vclamp(t1, zero, qmax));
    const V r2 = t2 - vround(vclamp(t2, zero, qmax));
    a1 += r1 * r1;
    a2 += r2 * r2;
  }
  *e1 = a1 * (s1 * s1);
  *e2 = a2 * (s2 * s2);
}

template <typename V>
CNR_INLINE V grid_error(const float* xt, int64_t dim, V lo, V s, V qmax) {
  V e, unused;
  grid_error2(xt, dim, lo, s, lo, s, qmax, &e, &unused);
  return e;
}

template <typename V>
struct BlockRange {
  V mn, mx;
  IntVec<V> bad;
};

// Lane min / max; zeroes the columns of lanes holding a NaN or Inf so that the
// search stays finite (those rows get a NaN grid and are reported by the encoder).
template <typename V>
CNR_INLINE BlockRange<V> block_range(float* xt, int64_t dim) {
  constexpr int W = width_of<V>;
  BlockRange<V> r{splat<V>(std::numeric_limits<float>::infinity()), splat<V>(-std::numeric_limits<float>::infinity()),
                  IntVec<V>{}};
  for (int64_t j = 0; j < dim; ++j) {
    const V x = vload<V>(xt + j * W);
    r.bad |= nonfinite_v(x);
    r.mn = vmin(r.mn, x);
    r.mx = vmax(r.mx, x);
  }
  bool any_bad = false;
  for (int l = 0; l < W; ++l) any_bad |= r.bad[l] != 0;
  if (any_bad) {  // rare: redo the lanes' range without the bad rows
    r.mn = splat<V>(std::numeric_limits<float>::infinity());
    r.mx = -r.mn;
    for (int64_t j = 0; j < dim; ++j) {
      const V x = r.bad ? splat<V>(0.0f) : vload<V>(xt + j * W);
      vstore(xt + j * W, x);
      r.mn = vmin(r.mn, x);
      r.mx = vmax(r.mx, x);
    }
  }
  return r;
}

// One least-squares refit: given the codes q of the grid (lo, s), the (bias, step)
// minimising sum (x - bias - step * q)^2. Sums run on x - mn to avoid cancellation.
template <typename V>
CNR_INLINE void refit(const float* xt, int64_t dim, V mn, V qmax, V* lo, V* s) {
  constexpr int W = width_of<V>;
  const V inv = safe_inverse(*s), zero = splat<V>(0.0f);
  V su{}, suq{}, sq{}, sqq{};
  for (int64_t j = 0; j < dim; ++j) {
    const V x = vload<V>(xt + j * W);
    const V q = vround(vclamp((x - *lo) * inv, zero, qmax));
    const V u = x - mn;
    su += u;
    suq += u * q;
    sq += q;
    sqq += q * q;
  }
  const V n = splat<V>(static_cast<float>(dim));
  const V var_q = sqq - sq * sq / n, cov = suq - su * sq / n;
  const auto fit = (var_q > 0.0f) & (cov > 0.0f);  // else one code only: nothing to fit
  const V step = cov / (fit ? var_q : splat<V>(1.0f));
  *s = fit ? step : *s;
  *lo = fit ? (su - step * sq) / n + mn : *lo;
}

struct SearchArgs {
  const float* rows;
  int64_t n, dim;
  int qmax;
  int64_t num_bins, rounds, refit_iters, grid;  // grid > 0: exhaustive search
  float* lo_out;                                // the grids (adaptive_search, exhaustive_search)
  float* step_out;
  // adaptive_quantize: the block is quantized on its grid while still in cache.
  int64_t bits, nb;
  at::ScalarType scale_dtype, bias_dtype;
  uint8_t* payload;
  void* scale;
  void* bias;
  uint8_t* status;
};

template <typename V>
CNR_INLINE void adaptive_block(float* xt, const SearchArgs& a, V* out_lo, V* out_step) {
  const BlockRange<V> br = block_range<V>(xt, a.dim);
  const V qmax = splat<V>(static_cast<float>(a.qmax));
  const V range = br.mx - br.mn;
  const V step = range / static_cast<float>(a.num_bins);
  V best_lo = br.mn, best_s = range / qmax;
  V best_e = grid_error(xt, a.dim, best_lo, best_s, qmax);
  // Moves are counted, not accumulated, so lo / hi carry no rounding drift.
  V ups{}, downs{};
  const V zero = splat<V>(0.0f), one = splat<V>(1.0f);
  for (int64_t k = 0; k < a.rounds; ++k) {
    const V lo_up = br.mn + (ups + 1.0f) * step, hi_keep = br.mx - downs * step;
    const V lo_keep = br.mn + ups * step, hi_down = br.mx - (downs + 1.0f) * step;
    const V s_up = (hi_keep - lo_up) / qmax, s_down = (hi_down - lo_keep) / qmax;
    V e_up, e_down;
    grid_error2(xt, a.dim, lo_up, s_up, lo_keep, s_down, qmax, &e_up, &e_down);
    const auto up = e_up < e_down;  // a tie moves max down
    ups += up ? one : zero;
    downs += up ? zero : one;
    const V e = up ? e_up : e_down;
    const auto better = e < best_e;
    best_e = better ? e : best_e;
    best_lo = better ? (up ? lo_up : lo_keep) : best_lo;
    best_s = better ? (up ? s_up : s_down) : best_s;
  }
  if (a.refit_iters > 0) {
    V lo = best_lo, s = best_s;
    for (int64_t it = 0; it < a.refit_iters; ++it) refit(xt, a.dim, br.mn, qmax, &lo, &s);
    const auto better = grid_error(xt, a.dim, lo, s, qmax) < best_e;
    best_lo = better ? lo : best_lo;
    best_s = better ? s : best_s;
  }
  const V nan = splat<V>(std::numeric_limits<float>::quiet_NaN());
  *out_lo = br.bad ? nan : best_lo;
  *out_step = br.bad ? nan : best_s;
}

template <typename V>
CNR_INLINE void exhaustive_block(float* xt, const SearchArgs& a, V* out_lo, V* out_step) {
  const BlockRange<V> br = block_range<V>(xt, a.dim);
  const V qmax = splat<V>(static_cast<float>(a.qmax));
  const V range = br.mx - br.mn;
  const float g = static_cast<float>(a.grid);
  V best_lo = br.mn, best_s = range / qmax;
  V best_e = grid_error(xt, a.dim, best_lo, best_s, qmax);
  for (int64_t i = 0; i < a.grid; ++i) {
    const V lo = br.mn + range * (static_cast<float>(i) / g);
    // hi = max - range * j / grid for every j with lo < hi, two per pass.
    for (int64_t j = 0; i + j < a.grid; j += 2) {
      const V hi1 = br.mx - range * (static_cast<float>(j) / g);
      const V hi2 = i + j + 1 < a.grid ? br.mx - range * (static_cast<float>(j + 1) / g) : hi1;
      const V s1 = (hi1 - lo) / qmax, s2 = (hi2 - lo) / qmax;
      V e1, e2;
      grid_error2(xt, a.dim, lo, s1, lo, s2, qmax, &e1, &e2);
      for (const auto& [e, s] : {std::pair<V, V>{e1, s1}, std::pair<V, V>{e2, s2}}) {
        const auto better = e < best_e;
        best_e = better ? e : best_e;
        best_lo = better ? lo : best_lo;
        best_s = better ? s : best_s;
      }
    }
  }
  const V nan = splat<V>(std::numeric_limits<float>::quiet_NaN());
  *out_lo = br.bad ? nan : best_lo;
  *out_step = br.bad ? nan : best_s;
}

// Quantizes the block on the lanes' grids, exactly as quantize_uniform does with
// grid_bias / grid_scale: stored bias rounded down, scale up, codes against them.
template <typename V>
CNR_INLINE void quantize_block(const float* xt, const SearchArgs& a, int64_t r0, int64_t cnt, V lo, V s) {
  constexpr int W = width_of<V>;
  V lo_st{}, s_st{};
  uint8_t* out[W];
  for (int64_t l = 0; l < cnt; ++l) {
    const int64_t r = r0 + l;
    uint8_t flags = finite(lo[l]) && finite(s[l]) ? 0 : kNonFinite;  // NaN marks a row with NaN / Inf
    float b = flags ? 0.0f : round_param_w<W>(lo[l], a.bias_dtype, -1);
    float st = flags ? 0.0f : round_param_w<W>(s[l], a.scale_dtype, +1);
    if (!flags && !(finite(b) && finite(st))) flags = kOverflow;
    if (flags) b = st = 0.0f;
    a.status[r] = flags;
    store_param_w<W>(a.scale, r, st, a.scale_dtype);
    store_param_w<W>(a.bias, r, b, a.bias_dtype);
    lo_st[l] = b;
    s_st[l] = st;
    out[l] = a.payload + r * a.nb;
  }
  const V inv = safe_inverse(s_st), zero = splat<V>(0.0f), qmax = splat<V>(static_cast<float>(a.qmax));
  pack_lanes<V>(a.dim, static_cast<int>(a.bits), cnt, out,
                [&](int64_t j) { return vround(vclamp((vload<V>(xt + j * W) - lo_st) * inv, zero, qmax)); });
  for (int64_t l = 0; l < cnt; ++l) {
    if (a.status[r0 + l]) std::memset(out[l], 0, a.nb);  // keep rejected rows deterministic
  }
}

// Blocks [b0, b1) of W rows each.
template <int W>
void search_blocks(const SearchArgs& a, int64_t b0, int64_t b1) {
  using V = typename Lanes<W>::f;
  std::vector<float> xt(a.dim * W);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t r0 = b * W, cnt = std::min<int64_t>(W, a.n - r0);
    transpose_block<W>(a.rows, r0, cnt, a.dim, xt.data());
    V lo, s;
    if (a.grid > 0) {
      exhaustive_block<V>(xt.data(), a, &lo, &s);
    } else {
      adaptive_block<V>(xt.data(), a, &lo, &s);
    }
    if (a.payload) {
      quantize_block<V>(xt.data(), a, r0, cnt, lo, s);
      continue;
    }
    for (int64_t i = 0; i < cnt; ++i) {
      a.lo_out[r0 + i] = lo[i];
      a.step_out[r0 + i] = s[i];
    }
  }
}
CNR_LANE_VARIANTS(search_blocks, (const SearchArgs& a, int64_t b0, int64_t b1), (a, b0, b1))

std::tuple<at::Tensor, at::Tensor> run_search(const at::Tensor& rows, const char* op, SearchArgs args) {
  const auto x = checked_rows(rows, op);
  auto lo = at::empty({x.size(0)}, x.options());
  auto step = at::empty({x.size(0)}, x.options());
  args.rows = x.data_ptr<float>();
  args.n = x.size(0);
  args.dim = x.size(1);
  args.lo_out = lo.data_ptr<float>();
  args.step_out = step.data_ptr<float>();
  const int64_t w = lane_width(), blocks = (args.n + w - 1) / w;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 1024 / (w * args.dim)),
                   [&](int64_t b0, int64_t b1) { CNR_LANE_DISPATCH(search_blocks, (args, b0, b1)); });
  return {lo, step};
}

SearchArgs adaptive_args(int64_t bits, int64_t num_bins, double ratio, int64_t refit_iters, const char* op) {
  check_search(bits, num_bins, ratio, refit_iters, op);
  SearchArgs args{};
  args.qmax = (1 << bits) - 1;
  args.num_bins = num_bins;
  // After k moves the range is (1 - k / num_bins) of the original, so "move while
  // range >= ratio * original" makes the same number of moves in every row; the
  // last move that would leave an empty range is not tried.
  args.rounds = std::min<int64_t>(num_bins - 1, static_cast<int64_t>(std::floor(num_bins * (1.0 - ratio) + 1e-9)) + 1);
  args.refit_iters = refit_iters;
  return args;
}

std::tuple<at::Tensor, at::Tensor> adaptive_search_cpu(const at::Tensor& rows, int64_t bits, int64_t num_bins,
                                                       double ratio, int64_t refit_iters) {
  return run_search(rows, "adaptive_search", adaptive_args(bits, num_bins, ratio, refit_iters, "adaptive_search"));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> adaptive_quantize_cpu(
    const at::Tensor& rows, int64_t bits, int64_t num_bins, double ratio, int64_t refit_iters,
    at::ScalarType scale_dtype, at::ScalarType bias_dtype) {
  SearchArgs a = adaptive_args(bits, num_bins, ratio, refit_iters, "adaptive_quantize");
  check_param_dtype(scale_dtype, "scale_dtype", "adaptive_quantize");
  check_param_dtype(bias_dtype, "bias_dtype", "adaptive_quantize");
  const auto x = checked_rows(rows, "adaptive_quantize");
  a.rows = x.data_ptr<float>();
  a.n = x.size(0);
  a.dim = x.size(1);
  a.bits = bits;
  a.nb = packed_bytes(a.dim, bits);
  a.scale_dtype = scale_dtype;
  a.bias_dtype = bias_dtype;
  auto payload = at::empty({a.n, a.nb}, x.options().dtype(at::kByte));
  auto scale = at::empty({a.n}, x.options().dtype(scale_dtype));
  auto bias = at::empty({a.n}, x.options().dtype(bias_dtype));
  auto status = at::empty({a.n}, x.options().dtype(at::kByte));
  a.payload = payload.data_ptr<uint8_t>();
  a.scale = scale.data_ptr();
  a.bias = bias.data_ptr();
  a.status = status.data_ptr<uint8_t>();
  const int64_t w = lane_width(), blocks = (a.n + w - 1) / w;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 1024 / (w * a.dim)),
                   [&](int64_t b0, int64_t b1) { CNR_LANE_DISPATCH(search_blocks, (a, b0, b1)); });
  return {payload, scale, bias, status};
}

std::tuple<at::Tensor, at::Tensor> exhaustive_search_cpu(const at::Tensor& rows, int64_t bits, int64_t grid) {
  check_bits(bits, "exhaustive_search");
  TORCH_CHECK_VALUE(grid >= 1, "cnr::exhaustive_search: grid must be >= 1, got ", grid);
  SearchArgs args{};
  args.qmax = (1 << bits) - 1;
  args.grid = grid;
  return run_search(rows, "exhaustive_search", args);
}

}  // namespace
}  // namespace cnr::codecs

TORCH_LIBRARY_IMPL(cnr, CPU, m) {
  m.impl("adaptive_search", &cnr::codecs::adaptive_search_cpu);
  m.impl("adaptive_quantize", &cnr::codecs::adaptive_quantize_cpu);
  m.impl("exhaustive_search", &cnr::codecs::exhaustive_search_cpu);
}
