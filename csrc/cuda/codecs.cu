// CUDA kernels of the row codecs (see codecs.cuh). No torch header.
//
// Row kernels give each row one warp: lanes stride over the values, warp
// reductions run in one fixed shuffle order and broadcast lane 0's result, so
// every lane takes the same decision and the bytes are deterministic. Arithmetic
// uses the _rn intrinsics so that nvcc does not contract it into FMAs, which
// keeps quantization bit-identical to the CPU kernels.
#include "codecs.cuh"
#include "launch.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>

namespace cnr::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxCentroids = 256;
constexpr uint8_t kNonFinite = 1, kOverflow = 2;

int blocks_for(int64_t work, int per_block) {
  const int64_t b = (work + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

__device__ __forceinline__ int64_t packed_bytes(int64_t dim, int bits) { return (dim * bits + 7) / 8; }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_down_sync(kFull, v, o));
  return __shfl_sync(kFull, v, 0);
}
__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_down_sync(kFull, v, o));
  return __shfl_sync(kFull, v, 0);
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_down_sync(kFull, v, o));
  return __shfl_sync(kFull, v, 0);
}

__device__ __forceinline__ bool finite(float v) { return fabsf(v) <= FLT_MAX; }

// Round to the storage dtype: nearest (0), up (> 0) or down (< 0); inf = overflow.
__device__ __forceinline__ float round_param(float v, bool half, int dir) {
  if (!half) return v;
  return __half2float(dir > 0 ? __float2half_ru(v) : dir < 0 ? __float2half_rd(v) : __float2half_rn(v));
}
__device__ __forceinline__ void store_param(void* p, int64_t i, float v, bool half) {
  if (half) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);  // exact: v is a float16 value
  } else {
    static_cast<float*>(p)[i] = v;
  }
}
__device__ __forceinline__ float load_param(const void* p, int64_t i, bool half) {
  return half ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Smallest stored step whose grid reaches span = qmax * step.
__device__ float covering_scale(float span, int qmax, bool half) {
  float s = round_param(__fdiv_rn(span, static_cast<float>(qmax)), half, +1);
  while (finite(s) && __fmul_rn(s, static_cast<float>(qmax)) < span) {
    s = half ? __half2float(__ushort_as_half(static_cast<unsigned short>(__half_as_ushort(__float2half_rn(s)) + 1)))
             : nextafterf(s, INFINITY);
  }
  return s;
}

__device__ __forceinline__ float inverse(float s) { return s > 0.0f ? __frcp_rn(s) : 0.0f; }

// The code of x on the grid lo + s * q, q in [qmin, qmax], stored as q - qmin.
__device__ __forceinline__ uint32_t code_of(float x, float lo, float inv, float qmin, float qmax) {
  const float t = fminf(fmaxf(__fmul_rn(__fsub_rn(x, lo), inv), qmin), qmax);
  return static_cast<uint32_t>(__fsub_rn(rintf(t), qmin));
}

// Writes the group of eight codes packed in w: `bits` bytes, fewer for the row's last group.
__device__ __forceinline__ void store_group(uint8_t* row, int64_t g, int64_t dim, int bits, uint64_t w) {
  const int64_t rest = dim - g * 8;
  const int nbytes = rest >= 8 ? bits : static_cast<int>((rest * bits + 7) / 8);
  for (int i = 0; i < nbytes; ++i) row[g * bits + i] = static_cast<uint8_t>(w >> (8 * i));
}
__device__ __forceinline__ uint64_t load_group(const uint8_t* row, int64_t g, int64_t dim, int bits) {
  const int64_t rest = dim - g * 8;
  const int nbytes = rest >= 8 ? bits : static_cast<int>((rest * bits + 7) / 8);
  uint64_t w = 0;
  for (int i = 0; i < nbytes; ++i) w |= static_cast<uint64_t>(row[g * bits + i]) << (8 * i);
  return w;
}

__global__ void pack_kernel(const uint8_t* __restrict__ codes, int64_t n, int64_t dim, int bits,
                            uint8_t* __restrict__ packed) {
  const int64_t groups = (dim + 7) / 8, nb = packed_bytes(dim, bits);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n * groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / groups, g = t % groups;
    uint64_t w = 0;
    for (int k = 0; k < 8 && g * 8 + k < dim; ++k) w |= static_cast<uint64_t>(codes[r * dim + g * 8 + k]) << (bits * k);
    store_group(packed + r * nb, g, dim, bits, w);
  }
}

__global__ void unpack_kernel(const uint8_t* __restrict__ packed, int64_t n, int64_t dim, int bits,
                              uint8_t* __restrict__ codes) {
  const int64_t groups = (dim + 7) / 8, nb = packed_bytes(dim, bits);
  const uint64_t mask = (1u << bits) - 1;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n * groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / groups, g = t % groups;
    const uint64_t w = load_group(packed + r * nb, g, dim, bits);
    for (int k = 0; k < 8 && g * 8 + k < dim; ++k) {
      codes[r * dim + g * 8 + k] = static_cast<uint8_t>((w >> (bits * k)) & mask);
    }
  }
}

// Warp-per-row loop: row index of this warp, striding over the grid.
#define FOR_EACH_ROW(r, n)                                                                           \
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; r < (n); \
       r += static_cast<int64_t>(gridDim.x) * kWarps)

__global__ void cast_kernel(const float* __restrict__ rows, int64_t n, int64_t dim, int dtype,
                            uint8_t* __restrict__ payload, uint8_t* __restrict__ status) {
  const int lane = threadIdx.x % 32;
  FOR_EACH_ROW(r, n) {
    const float* x = rows + r * dim;
    bool bad = false, inf = false;
    for (int64_t j = lane; j < dim; j += 32) {
      const float v = x[j];
      bad |= !finite(v);
      if (dtype == 0) {
        reinterpret_cast<float*>(payload + r * dim * 4)[j] = v;
      } else if (dtype == 1) {
        const __half h = __float2half_rn(v);
        reinterpret_cast<__half*>(payload + r * dim * 2)[j] = h;
        inf |= __hisinf(h) != 0;
      } else {
        const __nv_bfloat16 h = __float2bfloat16_rn(v);
        reinterpret_cast<__nv_bfloat16*>(payload + r * dim * 2)[j] = h;
        inf |= __hisinf(h) != 0;
      }
    }
    bad = __any_sync(kFull, bad);
    inf = __any_sync(kFull, inf);
    if (bad || inf) {  // a flagged row is zeroed, as on the CPU
      const int64_t width = dtype == 0 ? 4 : 2;
      for (int64_t j = lane; j < dim * width; j += 32) payload[r * dim * width + j] = 0;
    }
    if (lane == 0) status[r] = bad ? kNonFinite : (inf ? kOverflow : 0);
  }
}

__global__ void quantize_kernel(const float* __restrict__ rows, int64_t n, int64_t dim, int bits, bool symmetric,
                                bool scale_half, bool bias_half, const float* __restrict__ grid_bias,
                                const float* __restrict__ grid_scale, uint8_t* __restrict__ payload, void* scale,
                                void* bias, uint8_t* __restrict__ status) {
  const int lane = threadIdx.x % 32;
  const int64_t nb = packed_bytes(dim, bits), groups = (dim + 7) / 8;
  const int qmax = symmetric ? (1 << (bits - 1)) - 1 : (1 << bits) - 1;
  FOR_EACH_ROW(r, n) {
    const float* x = rows + r * dim;
    float mn = INFINITY, mx = -INFINITY;
    bool bad = false;
    for (int64_t j = lane; j < dim; j += 32) {
      mn = fminf(mn, x[j]);
      mx = fmaxf(mx, x[j]);
      bad |= !finite(x[j]);
    }
    mn = warp_min(mn);
    mx = warp_max(mx);
    const bool bad_grid = grid_bias && !(finite(grid_bias[r]) && finite(grid_scale[r]) && grid_scale[r] >= 0.0f);
    bad = __any_sync(kFull, bad) || bad_grid;
    float lo = 0.0f, step = 0.0f;
    uint8_t flags = bad ? kNonFinite : 0;
    if (!bad && symmetric) {
      const float amax = __fadd_rn(fmaxf(-mn, mx), 0.0f);  // + 0: a zero row's scale is +0, as on the CPU
      bool other = false;  // a magnitude other than 0 and amax
      for (int64_t j = lane; j < dim; j += 32) other |= fabsf(x[j]) != 0.0f && fabsf(x[j]) != amax;
      step = __any_sync(kFull, other) ? covering_scale(amax, qmax, scale_half) : round_param(amax, scale_half, +1);
    } else if (!bad && grid_bias) {
      lo = round_param(grid_bias[r], bias_half, -1);
      step = round_param(grid_scale[r], scale_half, +1);
    } else if (!bad) {
      lo = round_param(mn, bias_half, -1);
      step = covering_scale(__fsub_rn(mx, lo), qmax, scale_half);
    }
    if (!flags && !(finite(lo) && finite(step))) flags = kOverflow;
    if (flags) lo = step = 0.0f;
    const float inv = inverse(step), qmin = symmetric ? static_cast<float>(-qmax) : 0.0f;
    uint8_t* out = payload + r * nb;
    for (int64_t g = lane; g < groups; g += 32) {
      uint64_t w = 0;
      for (int k = 0; k < 8 && g * 8 + k < dim; ++k) {
        if (flags) continue;
        w |= static_cast<uint64_t>(code_of(x[g * 8 + k], lo, inv, qmin, static_cast<float>(qmax))) << (bits * k);
      }
      store_group(out, g, dim, bits, w);
    }
    if (lane == 0) {
      status[r] = flags;
      store_param(scale, r, step, scale_half);
      if (!symmetric) store_param(bias, r, lo, bias_half);
    }
  }
}

__global__ void dequantize_kernel(const uint8_t* __restrict__ payload, int64_t n, int64_t dim, int bits,
                                  const void* scale, bool scale_half, const void* bias, bool bias_half,
                                  float* __restrict__ out) {
  const int64_t groups = (dim + 7) / 8, nb = packed_bytes(dim, bits);
  const uint64_t mask = (1u << bits) - 1;
  const float shift = bias ? 0.0f : static_cast<float>((1 << (bits - 1)) - 1);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n * groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / groups, g = t % groups;
    const float s = load_param(scale, r, scale_half), lo = bias ? load_param(bias, r, bias_half) : 0.0f;
    const uint64_t w = load_group(payload + r * nb, g, dim, bits);
    for (int k = 0; k < 8 && g * 8 + k < dim; ++k) {
      const float q = __fsub_rn(static_cast<float>((w >> (bits * k)) & mask), shift);
      out[r * dim + g * 8 + k] = __fadd_rn(lo, __fmul_rn(s, q));
    }
  }
}

// Squared error of the row on the grid (lo, s), in x units; every lane gets it.
__device__ float grid_error(const float* x, int64_t dim, float lo, float s, float qmax) {
  const float inv = inverse(s);
  float acc = 0.0f;
  for (int64_t j = threadIdx.x % 32; j < dim; j += 32) {
    const float t = __fmul_rn(__fsub_rn(x[j], lo), inv);
    const float r = __fsub_rn(t, rintf(fminf(fmaxf(t, 0.0f), qmax)));
    acc = __fadd_rn(acc, __fmul_rn(r, r));
  }
  return __fmul_rn(warp_sum(acc), __fmul_rn(s, s));
}

__global__ void adaptive_kernel(const float* __restrict__ rows, int64_t n, int64_t dim, int bits, int64_t num_bins,
                                int64_t rounds, int64_t refit_iters, float* __restrict__ lo_out,
                                float* __restrict__ scale_out) {
  const int lane = threadIdx.x % 32;
  const float qmax = static_cast<float>((1 << bits) - 1);
  FOR_EACH_ROW(r, n) {
    const float* x = rows + r * dim;
    float mn = INFINITY, mx = -INFINITY;
    bool bad = false;
    for (int64_t j = lane; j < dim; j += 32) {
      mn = fminf(mn, x[j]);
      mx = fmaxf(mx, x[j]);
      bad |= !finite(x[j]);
    }
    mn = warp_min(mn);
    mx = warp_max(mx);
    if (__any_sync(kFull, bad)) {
      if (lane == 0) lo_out[r] = scale_out[r] = NAN;
      continue;
    }
    const float range = __fsub_rn(mx, mn), step = __fdiv_rn(range, static_cast<float>(num_bins));
    float best_lo = mn, best_s = __fdiv_rn(range, qmax);
    float best_e = grid_error(x, dim, best_lo, best_s, qmax);
    float ups = 0.0f, downs = 0.0f;
    for (int64_t k = 0; k < rounds; ++k) {
      const float lo_up = __fadd_rn(mn, __fmul_rn(ups + 1.0f, step)), hi_keep = __fsub_rn(mx, __fmul_rn(downs, step));
      const float lo_keep = __fadd_rn(mn, __fmul_rn(ups, step)), hi_down = __fsub_rn(mx, __fmul_rn(downs + 1.0f, step));
      const float s_up = __fdiv_rn(__fsub_rn(hi_keep, lo_up), qmax);
      const float s_down = __fdiv_rn(__fsub_rn(hi_down, lo_keep), qmax);
      const float e_up = grid_error(x, dim, lo_up, s_up, qmax), e_down = grid_error(x, dim, lo_keep, s_down, qmax);
      const bool up = e_up < e_down;  // a tie moves max down
      ups += up ? 1.0f : 0.0f;
      downs += up ? 0.0f : 1.0f;
      const float e = up ? e_up : e_down;
      if (e < best_e) {
        best_e = e;
        best_lo = up ? lo_up : lo_keep;
        best_s = up ? s_up : s_down;
      }
    }
    float lo = best_lo, s = best_s;
    for (int64_t it = 0; it < refit_iters; ++it) {  // least-squares (bias, step) for the current codes
      const float inv = inverse(s);
      float su = 0.0f, suq = 0.0f, sq = 0.0f, sqq = 0.0f;
      for (int64_t j = lane; j < dim; j += 32) {
        const float q = rintf(fminf(fmaxf(__fmul_rn(__fsub_rn(x[j], lo), inv), 0.0f), qmax));
        const float u = __fsub_rn(x[j], mn);
        su = __fadd_rn(su, u);
        suq = __fadd_rn(suq, __fmul_rn(u, q));
        sq = __fadd_rn(sq, q);
        sqq = __fadd_rn(sqq, __fmul_rn(q, q));
      }
      const double nd = static_cast<double>(dim);
      const double s_u = warp_sum(su), s_uq = warp_sum(suq), s_q = warp_sum(sq), s_qq = warp_sum(sqq);
      // The _rn intrinsics keep nvcc from fusing these into FMAs, so the emulation rounds as the GPU does.
      const double var_q = __dsub_rn(s_qq, __ddiv_rn(__dmul_rn(s_q, s_q), nd));
      const double cov = __dsub_rn(s_uq, __ddiv_rn(__dmul_rn(s_u, s_q), nd));
      if (var_q > 0.0 && cov > 0.0) {
        const double st = __ddiv_rn(cov, var_q);
        s = static_cast<float>(st);
        lo = static_cast<float>(__dadd_rn(__ddiv_rn(__dsub_rn(s_u, __dmul_rn(st, s_q)), nd), mn));
      }
    }
    if (refit_iters > 0 && grid_error(x, dim, lo, s, qmax) < best_e) {
      best_lo = lo;
      best_s = s;
    }
    if (lane == 0) {
      lo_out[r] = best_lo;
      scale_out[r] = best_s;
    }
  }
}

__global__ void kmeans_kernel(const float* __restrict__ rows, int64_t n, int64_t dim, int bits, int64_t iters,
                              bool codebook_half, const float* __restrict__ grid_bias,
                              const float* __restrict__ grid_scale, uint8_t* __restrict__ payload,
                              float* __restrict__ bias_out, void* codebook, uint8_t* __restrict__ status) {
  __shared__ float cent[kWarps][kMaxCentroids];
  __shared__ float mids[kWarps][kMaxCentroids];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* c = cent[warp];
  float* m = mids[warp];
  const int K = static_cast<int>(dim < (int64_t{1} << bits) ? dim : (int64_t{1} << bits));
  const bool exact = dim <= (int64_t{1} << bits);
  const int64_t nb = packed_bytes(dim, bits), groups = (dim + 7) / 8;
  FOR_EACH_ROW(r, n) {
    const float* x = rows + r * dim;
    float mn = INFINITY, mx = -INFINITY;
    bool bad = false;
    for (int64_t j = lane; j < dim; j += 32) {
      mn = fminf(mn, x[j]);
      mx = fmaxf(mx, x[j]);
      bad |= !finite(x[j]);
    }
    mn = warp_min(mn);
    mx = warp_max(mx);
    bad = __any_sync(kFull, bad);
    uint8_t flags = bad ? kNonFinite : 0;
    // Centroids as offsets from mn.
    if (bad) {
      for (int k = lane; k < K; k += 32) c[k] = 0.0f;
    } else if (exact) {  // the row's sorted values: each value's rank is its slot
      for (int64_t j = lane; j < dim; j += 32) {
        int rank = 0;
        for (int64_t i = 0; i < dim; ++i) rank += x[i] < x[j] || (x[i] == x[j] && i < j);
        c[rank] = __fsub_rn(x[j], mn);
      }
    } else {  // a uniform grid: the given one, or [min, max]
      float start = 0.0f, step = __fdiv_rn(__fsub_rn(mx, mn), static_cast<float>(K - 1));
      if (grid_bias && finite(grid_bias[r]) && finite(grid_scale[r])) {
        start = __fsub_rn(grid_bias[r], mn);
        step = grid_scale[r];
      }
      for (int k = lane; k < K; k += 32) c[k] = __fadd_rn(start, __fmul_rn(step, static_cast<float>(k)));
    }
    __syncwarp();
    float total = 0.0f;
    for (int64_t j = lane; j < dim; j += 32) total = __fadd_rn(total, __fsub_rn(x[j], mn));
    total = warp_sum(total);
    for (int64_t it = 0; !bad && !exact && it < iters; ++it) {
      for (int k = lane; k + 1 < K; k += 32) m[k] = __fmul_rn(__fadd_rn(c[k], c[k + 1]), 0.5f);
      __syncwarp();
      // Cluster k = values above threshold k - 1 but not above threshold k.
      float prev_sum = total, prev_cnt = static_cast<float>(dim), prev_c = 0.0f;
      for (int k = 0; k < K; ++k) {
        float sum_k = 0.0f, cnt_k = 0.0f;
        if (k + 1 < K) {
          for (int64_t j = lane; j < dim; j += 32) {
            const float u = __fsub_rn(x[j], mn);
            if (u > m[k]) {
              sum_k = __fadd_rn(sum_k, u);
              cnt_k += 1.0f;
            }
          }
          sum_k = warp_sum(sum_k);
          cnt_k = warp_sum(cnt_k);
        }
        const float s = __fsub_rn(prev_sum, sum_k), cnt = prev_cnt - cnt_k;
        float next = cnt > 0.0f ? __fdiv_rn(s, cnt) : c[k];  // an empty cluster keeps its centroid
        if (k > 0) next = fmaxf(next, prev_c);                 // rounding must not reorder the centroids
        __syncwarp();
        if (lane == 0) c[k] = next;
        prev_sum = sum_k;
        prev_cnt = cnt_k;
        prev_c = next;
      }
      __syncwarp();
    }
    // Store: bias = smallest centroid (float32), offsets of the others; then decoded centroids.
    const float c0 = c[0], base = __fadd_rn(mn, c0);
    bool overflow = false;
    __syncwarp();
    for (int k = lane + 1; k < K; k += 32) {
      const float off = round_param(__fsub_rn(c[k], c0), codebook_half, 0);
      overflow |= !finite(off);
      store_param(codebook, r * (K - 1) + k - 1, bad || !finite(off) ? 0.0f : off, codebook_half);
      m[k] = __fadd_rn(base, off);  // decoded centroid k, parked in m until all lanes read c
    }
    __syncwarp();
    if (lane == 0) m[0] = base;
    __syncwarp();
    for (int k = lane; k < K; k += 32) c[k] = m[k];
    __syncwarp();
    for (int k = lane; k + 1 < K; k += 32) m[k] = __fmul_rn(__fadd_rn(c[k], c[k + 1]), 0.5f);
    __syncwarp();
    if (__any_sync(kFull, overflow) && !flags) flags = kOverflow;
    uint8_t* out = payload + r * nb;
    for (int64_t g = lane; g < groups; g += 32) {
      uint64_t w = 0;
      for (int k = 0; k < 8 && g * 8 + k < dim; ++k) {
        uint32_t code = 0;
        for (int t = 0; t + 1 < K; ++t) code += x[g * 8 + k] > m[t];
        if (!flags) w |= static_cast<uint64_t>(code) << (bits * k);
      }
      store_group(out, g, dim, bits, w);
    }
    if (lane == 0) {
      bias_out[r] = bad ? 0.0f : base;
      status[r] = flags;
    }
    __syncwarp();
  }
}

__global__ void dequantize_codebook_kernel(const uint8_t* __restrict__ payload, int64_t n, int64_t dim, int bits,
                                           const float* __restrict__ bias, const void* codebook, bool codebook_half,
                                           int64_t k1, float* __restrict__ out, int* bad_code) {
  const int64_t groups = (dim + 7) / 8, nb = packed_bytes(dim, bits);
  const uint64_t mask = (1u << bits) - 1;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n * groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / groups, g = t % groups;
    const uint64_t w = load_group(payload + r * nb, g, dim, bits);
    for (int k = 0; k < 8 && g * 8 + k < dim; ++k) {
      int64_t q = static_cast<int64_t>((w >> (bits * k)) & mask);
      if (q > k1) {  // corrupt data: flag it, and read inside the codebook anyway
        atomicOr(bad_code, 1);
        q = k1;
      }
      out[r * dim + g * 8 + k] =
          q == 0 ? bias[r] : __fadd_rn(bias[r], load_param(codebook, r * k1 + q - 1, codebook_half));
    }
  }
}

}  // namespace

void pack_bits(const uint8_t* codes, int64_t n, int64_t dim, int bits, uint8_t* packed, cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(pack_kernel, blocks_for(n * ((dim + 7) / 8), kThreads), kThreads, 0, stream)(codes, n, dim, bits, packed);
}

void unpack_bits(const uint8_t* packed, int64_t n, int64_t dim, int bits, uint8_t* codes, cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(unpack_kernel, blocks_for(n * ((dim + 7) / 8), kThreads), kThreads, 0, stream)(packed, n, dim, bits, codes);
}

void cast_rows(const float* rows, int64_t n, int64_t dim, int dtype, uint8_t* payload, uint8_t* status,
               cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(cast_kernel, blocks_for(n, kWarps), kThreads, 0, stream)(rows, n, dim, dtype, payload, status);
}

void quantize_uniform(const float* rows, int64_t n, int64_t dim, int bits, bool symmetric, bool scale_half,
                      bool bias_half, const float* grid_bias, const float* grid_scale, uint8_t* payload, void* scale,
                      void* bias, uint8_t* status, cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(quantize_kernel, blocks_for(n, kWarps), kThreads, 0, stream)(rows, n, dim, bits, symmetric, scale_half, bias_half,
                                                                  grid_bias, grid_scale, payload, scale, bias, status);
}

void dequantize_uniform(const uint8_t* payload, int64_t n, int64_t dim, int bits, const void* scale, bool scale_half,
                        const void* bias, bool bias_half, float* out, cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(dequantize_kernel, blocks_for(n * ((dim + 7) / 8), kThreads), kThreads, 0, stream)(
      payload, n, dim, bits, scale, scale_half, bias, bias_half, out);
}

void adaptive_search(const float* rows, int64_t n, int64_t dim, int bits, int64_t num_bins, int64_t rounds,
                     int64_t refit_iters, float* lo, float* scale, cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(adaptive_kernel, blocks_for(n, kWarps), kThreads, 0, stream)(rows, n, dim, bits, num_bins, rounds, refit_iters,
                                                                  lo, scale);
}

void kmeans_quantize(const float* rows, int64_t n, int64_t dim, int bits, int64_t iters, bool codebook_half,
                     const float* grid_bias, const float* grid_scale, uint8_t* payload, float* bias, void* codebook,
                     uint8_t* status, cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(kmeans_kernel, blocks_for(n, kWarps), kThreads, 0, stream)(rows, n, dim, bits, iters, codebook_half, grid_bias,
                                                                grid_scale, payload, bias, codebook, status);
}

void dequantize_codebook(const uint8_t* payload, int64_t n, int64_t dim, int bits, const float* bias,
                         const void* codebook, bool codebook_half, int64_t k1, float* out, int* bad_code,
                         cudaStream_t stream) {
  if (n == 0) return;
  CNR_LAUNCH(dequantize_codebook_kernel, blocks_for(n * ((dim + 7) / 8), kThreads), kThreads, 0, stream)(
      payload, n, dim, bits, bias, codebook, codebook_half, k1, out, bad_code);
}

}  // namespace cnr::cuda
