// CPU kernel of per-row k-means (non-uniform) quantization.
//
// Each row gets K = min(2**bits, D) centroids. With D <= 2**bits the centroids
// are the row's own sorted values (exact up to their storage dtype); otherwise
// Lloyd's algorithm runs a fixed number of iterations from a deterministic start:
// a given asymmetric grid (the codec passes the adaptive search's) or the uniform
// grid over [min, max]. Nearest-centroid codes on a uniform grid are exactly
// uniform quantization's, and no Lloyd step raises the error, so k-means ends no
// worse than its starting grid.
//
// Storage: bias = the smallest centroid (float32, so a constant row decodes
// exactly), codebook = the other K - 1 centroids as offsets from it in
// float16 or float32. Codes index the centroids in ascending order.
//
// Like the searches, 16 rows run side by side, one per vector lane. In one
// dimension a Lloyd step needs only, per threshold between neighbouring
// centroids, the count and sum of the values above it: no per-value scatter.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "codecs_common.h"

namespace cnr::codecs {
namespace {

// Lloyd iterations on centroids held as offsets from the lane minimum mn. The
// lane vectors of centroid k live at c + k * W (plain float buffers: heap
// storage of over-aligned vector types is not reliably aligned).
template <typename V>
CNR_INLINE void lloyd(const float* xt, int64_t dim, V mn, int K, int64_t iters, float* c, float* mids,
                      float* above_sum, float* above_cnt) {
  constexpr int W = width_of<V>;
  V total{};
  for (int64_t j = 0; j < dim; ++j) total += vload<V>(xt + j * W) - mn;
  const V n = splat<V>(static_cast<float>(dim)), zero = splat<V>(0.0f), one = splat<V>(1.0f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int k = 0; k + 1 < K; ++k) {
      vstore(mids + k * W, (vload<V>(c + k * W) + vload<V>(c + (k + 1) * W)) * 0.5f);
      vstore(above_sum + k * W, zero);
      vstore(above_cnt + k * W, zero);
    }
    for (int64_t j = 0; j < dim; ++j) {
      const V u = vload<V>(xt + j * W) - mn;
      for (int k = 0; k + 1 < K; ++k) {
        const auto m = u > vload<V>(mids + k * W);
        vstore(above_sum + k * W, vload<V>(above_sum + k * W) + (m ? u : zero));
        vstore(above_cnt + k * W, vload<V>(above_cnt + k * W) + (m ? one : zero));
      }
    }
    // Cluster k holds the values above threshold k - 1 but not above threshold k.
    V prev_sum = total, prev_cnt = n, prev_c{};
    for (int k = 0; k < K; ++k) {
      const V sum_k = k + 1 < K ? vload<V>(above_sum + k * W) : zero;
      const V cnt_k = k + 1 < K ? vload<V>(above_cnt + k * W) : zero;
      const V s = prev_sum - sum_k, cnt = prev_cnt - cnt_k;
      V next = cnt > 0.0f ? s / cnt : vload<V>(c + k * W);  // an empty cluster keeps its centroid
      if (k > 0) next = vmax(next, prev_c);                  // rounding must not reorder the centroids
      vstore(c + k * W, next);
      prev_sum = sum_k;
      prev_cnt = cnt_k;
      prev_c = next;
    }
  }
}

struct KMeansArgs {
  const float* rows;
  int64_t n, dim, bits, nb, iters;
  int K;
  bool exact;  // D <= 2**bits: the centroids are the row's values
  at::ScalarType codebook_dtype;
  const float* grid_bias;  // null: Lloyd starts from the uniform grid over [min, max]
  const float* grid_scale;
  uint8_t* payload;
  float* bias;
  void* codebook;
  uint8_t* status;
};

// Blocks [b0, b1) of W rows each.
template <int W>
void kmeans_blocks(const KMeansArgs& a, int64_t b0, int64_t b1) {
  using V = typename Lanes<W>::f;
  const int K = a.K;
  const int64_t dim = a.dim;
  std::vector<float> xt(dim * W), sorted(dim), c(K * W), mids(K * W), above_sum(K * W), above_cnt(K * W);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t r0 = b * W, cnt = std::min<int64_t>(W, a.n - r0);
    transpose_block<W>(a.rows, r0, cnt, dim, xt.data());
    IntVec<V> bad{};
    V mn = splat<V>(std::numeric_limits<float>::infinity()), mx = -mn;
    for (int64_t j = 0; j < dim; ++j) bad |= nonfinite_v(vload<V>(xt.data() + j * W));
    for (int64_t j = 0; j < dim; ++j) {
      const V v = bad ? splat<V>(0.0f) : vload<V>(xt.data() + j * W);
      vstore(xt.data() + j * W, v);
      mn = vmin(mn, v);
      mx = vmax(mx, v);
    }
    if (a.exact) {
      for (int l = 0; l < W; ++l) {
        for (int64_t j = 0; j < dim; ++j) sorted[j] = xt[j * W + l];
        std::sort(sorted.begin(), sorted.end());
        for (int k = 0; k < K; ++k) c[k * W + l] = sorted[k] - mn[l];
      }
    } else {
      // Start from a uniform grid: its nearest-centroid codes are uniform quantization's,
      // so k-means ends no worse than that grid.
      V start = splat<V>(0.0f), step = (mx - mn) / static_cast<float>(K - 1);
      if (a.grid_bias) {
        for (int64_t l = 0; l < cnt; ++l) {
          const bool ok = !bad[l] && finite(a.grid_bias[r0 + l]) && finite(a.grid_scale[r0 + l]);
          start[l] = ok ? a.grid_bias[r0 + l] - mn[l] : 0.0f;
          step[l] = ok ? a.grid_scale[r0 + l] : step[l];
        }
      }
      for (int k = 0; k < K; ++k) vstore(c.data() + k * W, start + step * static_cast<float>(k));
      lloyd(xt.data(), dim, mn, K, a.iters, c.data(), mids.data(), above_sum.data(), above_cnt.data());
    }
    // Round to the stored codebook, then give every value the nearest stored centroid.
    for (int l = 0; l < cnt; ++l) {
      const int64_t r = r0 + l;
      const float c0 = c[l], base = mn[l] + c0;
      a.bias[r] = bad[l] ? 0.0f : base;
      uint8_t flags = bad[l] ? kNonFinite : 0;
      for (int k = 0; k < K; ++k) {
        const float off = k == 0 ? 0.0f : round_param_w<W>(c[k * W + l] - c0, a.codebook_dtype, 0);
        if (!finite(off) && !flags) flags = kOverflow;
        if (k > 0) store_param_w<W>(a.codebook, r * (K - 1) + k - 1, flags ? 0.0f : off, a.codebook_dtype);
        c[k * W + l] = base + off;  // the decoded centroid, as dequantize_codebook computes it
      }
      a.status[r] = flags;
    }
    for (int k = 0; k + 1 < K; ++k) {
      vstore(mids.data() + k * W, (vload<V>(c.data() + k * W) + vload<V>(c.data() + (k + 1) * W)) * 0.5f);
    }
    uint8_t* out[W];
    for (int l = 0; l < cnt; ++l) out[l] = a.payload + (r0 + l) * a.nb;
    const V zero = splat<V>(0.0f), one = splat<V>(1.0f);
    pack_lanes<V>(dim, static_cast<int>(a.bits), cnt, out, [&](int64_t j) {
      const V v = vload<V>(xt.data() + j * W);
      V code{};  // the number of midpoints below v; float lanes vectorise where mask arithmetic does not
      for (int k = 0; k + 1 < K; ++k) code += v > vload<V>(mids.data() + k * W) ? one : zero;
      return code;
    });
    for (int l = 0; l < cnt; ++l) {
      if (a.status[r0 + l]) std::memset(out[l], 0, a.nb);  // keep rejected rows deterministic
    }
  }
}
CNR_LANE_VARIANTS(kmeans_blocks, (const KMeansArgs& a, int64_t b0, int64_t b1), (a, b0, b1))

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kmeans_quantize_cpu(
    const at::Tensor& rows, int64_t bits, int64_t iters, at::ScalarType codebook_dtype,
    const std::optional<at::Tensor>& grid_bias, const std::optional<at::Tensor>& grid_scale) {
  const auto x = checked_rows(rows, "kmeans_quantize");
  check_kmeans(bits, iters, codebook_dtype);
  const auto [gb, gs] = checked_grid(grid_bias, grid_scale, x, /*symmetric=*/false, "kmeans_quantize");
  KMeansArgs a{};
  a.grid_bias = grid_bias ? gb.data_ptr<float>() : nullptr;
  a.grid_scale = grid_bias ? gs.data_ptr<float>() : nullptr;
  a.rows = x.data_ptr<float>();
  a.n = x.size(0);
  a.dim = x.size(1);
  a.bits = bits;
  a.nb = packed_bytes(a.dim, bits);
  a.iters = iters;
  a.K = static_cast<int>(std::min<int64_t>(int64_t{1} << bits, a.dim));
  a.exact = a.dim <= (int64_t{1} << bits);
  a.codebook_dtype = codebook_dtype;
  auto payload = at::empty({a.n, a.nb}, x.options().dtype(at::kByte));
  auto bias = at::empty({a.n}, x.options());
  auto codebook = at::empty({a.n, a.K - 1}, x.options().dtype(codebook_dtype));
  auto status = at::zeros({a.n}, x.options().dtype(at::kByte));
  a.payload = payload.data_ptr<uint8_t>();
  a.bias = bias.data_ptr<float>();
  a.codebook = codebook.data_ptr();
  a.status = status.data_ptr<uint8_t>();
  const int64_t w = lane_width(), blocks = (a.n + w - 1) / w;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 256 / (w * a.dim)),
                   [&](int64_t b0, int64_t b1) { CNR_LANE_DISPATCH(kmeans_blocks, (a, b0, b1)); });
  return {payload, bias, codebook, status};
}

}  // namespace
}  // namespace cnr::codecs

TORCH_LIBRARY_IMPL(cnr, CPU, m) { m.impl("kmeans_quantize", &cnr::codecs::kmeans_quantize_cpu); }
