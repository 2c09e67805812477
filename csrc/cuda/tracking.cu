// CUDA kernels of the dirty-row tracking ops (see tracking.cuh). No torch header.
#include "tracking.cuh"
#include "launch.cuh"

#include <climits>

namespace cnr::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long range_mask(int64_t w, int64_t start, int64_t end) {
  unsigned long long m = ~0ull;
  if (w == (start >> 6)) m &= ~0ull << (start & 63);
  if (w == ((end - 1) >> 6)) m &= ~0ull >> (63 - ((end - 1) & 63));
  return m;
}

template <typename index_t, typename offset_t>
__global__ void mark_rows_kernel(const index_t* __restrict__ indices, const offset_t* __restrict__ offsets,
                                 int64_t num_bags, const int64_t* __restrict__ B_offsets, int64_t T,
                                 const int64_t* __restrict__ hsc, const int64_t* __restrict__ rows_per_table,
                                 int64_t row_limit, unsigned long long* __restrict__ words,
                                 int32_t* __restrict__ counts, unsigned long long* __restrict__ invalid,
                                 int64_t num_indices) {
  const int64_t bags_per_feature = B_offsets ? 0 : num_bags / T;
  // The bag layout: offsets start at >= 0, never decrease, and end within the indices.
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b <= num_bags;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = static_cast<int64_t>(offsets[b]);
    const bool bad = (b == 0 && at < 0) || (b < num_bags && static_cast<int64_t>(offsets[b + 1]) < at) ||
                     (b == num_bags && at > num_indices);
    if (bad) atomicAdd(invalid + 2, 1ull);
  }
  const int64_t first = static_cast<int64_t>(offsets[0]) < 0 ? 0 : static_cast<int64_t>(offsets[0]);
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_indices;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Binary search for the feature whose index segment holds position i.
    int64_t lo = 0, hi = T;  // invariant: start(lo) <= i < start(hi)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      const int64_t bag = B_offsets ? B_offsets[mid] : mid * bags_per_feature;
      if (static_cast<int64_t>(offsets[bag]) <= i) lo = mid; else hi = mid;
    }
    const int64_t id = static_cast<int64_t>(indices[i]);
    if (id == -1) continue;  // a pruned row: FBGEMM's lookups skip it
    const int64_t row = hsc[lo] + id;
    // Features of one table share its base and size; the row must also fit the bitmap.
    if (id < 0 || id >= rows_per_table[lo] || row >= row_limit) {
      atomicAdd(invalid, 1ull);
      atomicMin(invalid + 1, static_cast<unsigned long long>(i));
      continue;
    }
    const unsigned long long mask = 1ull << (row & 63);
    unsigned long long* word = words + (row >> 6);
    if (!(*word & mask)) atomicOr(word, mask);
    if (counts) {
      int32_t cur = counts[row];
      while (cur != INT_MAX) {
        const int32_t prev = atomicCAS(counts + row, cur, cur + 1);
        if (prev == cur) break;
        cur = prev;
      }
    }
  }
}

__global__ void popcount_words_kernel(const unsigned long long* __restrict__ words, int64_t start, int64_t end,
                                      int64_t* __restrict__ counts) {
  const int64_t w0 = start >> 6, nw = ((end - 1) >> 6) - w0 + 1;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < nw;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    counts[k] = __popcll(words[w0 + k] & range_mask(w0 + k, start, end));
  }
}

__global__ void bits_to_rows_kernel(const unsigned long long* __restrict__ words, int64_t start, int64_t end,
                                    const int64_t* __restrict__ word_offsets, int64_t* __restrict__ rows) {
  const int64_t w0 = start >> 6, nw = ((end - 1) >> 6) - w0 + 1;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < nw;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    unsigned long long bits = words[w0 + k] & range_mask(w0 + k, start, end);
    int64_t* out = rows + word_offsets[k];
    while (bits) {
      *out++ = ((w0 + k) << 6) + __ffsll(static_cast<long long>(bits)) - 1;
      bits &= bits - 1;
    }
  }
}

__global__ void count_ranges_kernel(const unsigned long long* __restrict__ words,
                                    const int64_t* __restrict__ boundaries, int64_t* __restrict__ out) {
  __shared__ unsigned long long partial[kThreads];
  const int64_t start = boundaries[blockIdx.x], end = boundaries[blockIdx.x + 1];
  unsigned long long n = 0;
  if (start < end) {
    for (int64_t w = (start >> 6) + threadIdx.x; w <= ((end - 1) >> 6); w += blockDim.x) {
      n += __popcll(words[w] & range_mask(w, start, end));
    }
  }
  partial[threadIdx.x] = n;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int64_t>(partial[0]);
}

__global__ void clear_range_kernel(unsigned long long* __restrict__ words, int64_t start, int64_t end) {
  const int64_t w0 = start >> 6, nw = ((end - 1) >> 6) - w0 + 1;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < nw;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    words[w0 + k] &= ~range_mask(w0 + k, start, end);
  }
}

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

template <typename index_t>
void launch_mark(const index_t* indices, const void* offsets, bool offsets_are_int64, int64_t num_bags,
                 const int64_t* B_offsets, int64_t T, const int64_t* hsc, const int64_t* rows_per_table,
                 int64_t row_limit, unsigned long long* words, int32_t* counts, unsigned long long* invalid,
                 int64_t num_indices, cudaStream_t stream) {
  if (offsets_are_int64) {
    CNR_LAUNCH(mark_rows_kernel, blocks_for(num_indices), kThreads, 0, stream)(
        indices, static_cast<const int64_t*>(offsets), num_bags, B_offsets, T, hsc, rows_per_table, row_limit, words,
        counts, invalid, num_indices);
  } else {
    CNR_LAUNCH(mark_rows_kernel, blocks_for(num_indices), kThreads, 0, stream)(
        indices, static_cast<const int32_t*>(offsets), num_bags, B_offsets, T, hsc, rows_per_table, row_limit, words,
        counts, invalid, num_indices);
  }
}

}  // namespace

void mark_rows(const void* indices, bool indices_are_int64, const void* offsets, bool offsets_are_int64,
               int64_t num_bags, const int64_t* B_offsets, int64_t num_features, const int64_t* hash_size_cumsum,
               const int64_t* rows_per_table, int64_t row_limit, unsigned long long* words, int32_t* counts,
               unsigned long long* invalid, int64_t num_indices, cudaStream_t stream) {
  if (num_indices == 0 || num_bags == 0) return;
  if (indices_are_int64) {
    launch_mark(static_cast<const int64_t*>(indices), offsets, offsets_are_int64, num_bags, B_offsets, num_features,
                hash_size_cumsum, rows_per_table, row_limit, words, counts, invalid, num_indices, stream);
  } else {
    launch_mark(static_cast<const int32_t*>(indices), offsets, offsets_are_int64, num_bags, B_offsets, num_features,
                hash_size_cumsum, rows_per_table, row_limit, words, counts, invalid, num_indices, stream);
  }
}

void popcount_words(const unsigned long long* words, int64_t start, int64_t end, int64_t* counts,
                    cudaStream_t stream) {
  if (start >= end) return;
  const int64_t nw = ((end - 1) >> 6) - (start >> 6) + 1;
  CNR_LAUNCH(popcount_words_kernel, blocks_for(nw), kThreads, 0, stream)(words, start, end, counts);
}

void bits_to_rows(const unsigned long long* words, int64_t start, int64_t end, const int64_t* word_offsets,
                  int64_t* rows, cudaStream_t stream) {
  if (start >= end) return;
  const int64_t nw = ((end - 1) >> 6) - (start >> 6) + 1;
  CNR_LAUNCH(bits_to_rows_kernel, blocks_for(nw), kThreads, 0, stream)(words, start, end, word_offsets, rows);
}

void count_ranges(const unsigned long long* words, const int64_t* boundaries, int64_t num_ranges, int64_t* out,
                  cudaStream_t stream) {
  if (num_ranges == 0) return;
  count_ranges_kernel<<<static_cast<unsigned>(num_ranges), kThreads, 0, stream>>>(words, boundaries, out);
}

void clear_range(unsigned long long* words, int64_t start, int64_t end, cudaStream_t stream) {
  if (start >= end) return;
  const int64_t nw = ((end - 1) >> 6) - (start >> 6) + 1;
  CNR_LAUNCH(clear_range_kernel, blocks_for(nw), kThreads, 0, stream)(words, start, end);
}

}  // namespace cnr::cuda
