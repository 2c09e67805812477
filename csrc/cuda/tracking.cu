// CUDA kernels of the dirty-row tracking ops (see tracking.cuh). No torch header.
#include "tracking.cuh"
#include "launch.cuh"
#include "../lookup_record.h"

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

using ull = unsigned long long;

// Counts a problem and keeps the first position p of it (stored as INT64_MAX - p).
__device__ __forceinline__ void record_first(int64_t* record, int count_slot, int first_slot, int64_t p) {
  atomicAdd(reinterpret_cast<ull*>(record + count_slot), 1ull);
  atomicMax(reinterpret_cast<ull*>(record + first_slot), static_cast<ull>(INT64_MAX - p));
}

// The checks that stop a lookup: the row layout and B_offsets (one thread: T is
// small) and the bag offsets (grid-stride over the bag boundaries).
template <typename offset_t>
__global__ void check_lookup_kernel(const offset_t* __restrict__ offsets, int64_t num_bags,
                                    const int64_t* __restrict__ B_offsets, int64_t T, const int64_t* __restrict__ hsc,
                                    const int64_t* __restrict__ rows_per_table, int64_t row_limit,
                                    int64_t num_indices, int64_t* __restrict__ record) {
  using namespace lookup_record;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (tid == 0) {
    for (int64_t f = 0; f < T; ++f) {
      if (hsc[f] >= 0 && rows_per_table[f] >= 0 && hsc[f] + rows_per_table[f] <= row_limit) continue;
      if (record[kBadTables]++ == 0) {
        record[kFirstBadTable] = INT64_MAX - f;
        record[kTableStart] = hsc[f];
        record[kTableRows] = rows_per_table[f];
        record[kRowLimit] = row_limit;
      }
    }
    for (int64_t f = 0; B_offsets && f <= T; ++f) {
      record[kBadBatchOffsets] += (f == 0 && B_offsets[0] != 0) || (f > 0 && B_offsets[f] < B_offsets[f - 1]) ||
                                  (f == T && B_offsets[T] != num_bags);
    }
  }
  if (num_bags == 0) return;
  for (int64_t b = tid; b <= num_bags; b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = static_cast<int64_t>(offsets[b]);
    const bool bad = (b == 0 && at < 0) || (b < num_bags && static_cast<int64_t>(offsets[b + 1]) < at) ||
                     (b == num_bags && at > num_indices);
    if (bad) record_first(record, kBadBags, kFirstBadBag, b);
  }
}

// The feature whose index segment holds position i: the last one that starts at or before it.
template <typename offset_t>
__device__ int64_t feature_of(int64_t i, const offset_t* offsets, const int64_t* B_offsets, int64_t bags_per_feature,
                              int64_t T) {
  int64_t lo = 0, hi = T;  // invariant: start(lo) <= i < start(hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t bag = B_offsets ? B_offsets[mid] : mid * bags_per_feature;
    if (static_cast<int64_t>(offsets[bag]) <= i) lo = mid; else hi = mid;
  }
  return lo;
}

template <typename index_t, typename offset_t>
__global__ void mark_rows_kernel(const index_t* __restrict__ indices, const offset_t* __restrict__ offsets,
                                 int64_t num_bags, const int64_t* __restrict__ B_offsets, int64_t T,
                                 const int64_t* __restrict__ hsc, const int64_t* __restrict__ rows_per_table,
                                 ull* __restrict__ words, int32_t* __restrict__ counts, int64_t num_indices,
                                 int64_t* __restrict__ record) {
  if (lookup_record::stops_lookup(record)) return;  // check_lookup_kernel ran first on this stream
  const int64_t bags_per_feature = B_offsets ? 0 : num_bags / T;
  const int64_t first = static_cast<int64_t>(offsets[0]);
  const int64_t last = static_cast<int64_t>(offsets[num_bags]);
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < last;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t f = feature_of(i, offsets, B_offsets, bags_per_feature, T);
    const int64_t id = static_cast<int64_t>(indices[i]);
    if (id == -1) continue;  // a pruned row: FBGEMM's lookups skip it
    if (id < 0 || id >= rows_per_table[f]) {
      record_first(record, lookup_record::kBadIds, lookup_record::kFirstBadAt, i);
      continue;
    }
    const int64_t row = hsc[f] + id;
    const ull mask = 1ull << (row & 63);
    ull* word = words + (row >> 6);
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

// One thread: the details of the first problems, then the fold into `errors`.
template <typename index_t, typename offset_t>
__global__ void finish_record_kernel(const index_t* __restrict__ indices, const offset_t* __restrict__ offsets,
                                     int64_t num_bags, const int64_t* __restrict__ B_offsets, int64_t T,
                                     const int64_t* __restrict__ rows_per_table, int64_t num_indices,
                                     int64_t* __restrict__ record, int64_t* __restrict__ errors) {
  using namespace lookup_record;
  record[kNumBags] = num_bags;
  record[kNumIndices] = num_indices;
  if (record[kBadBags] > 0) {
    const int64_t b = INT64_MAX - record[kFirstBadBag];
    record[kBagStart] = static_cast<int64_t>(offsets[b]);
    record[kBagEnd] = b < num_bags ? static_cast<int64_t>(offsets[b + 1]) : 0;
  }
  if (record[kBadIds] > 0) {
    const int64_t i = INT64_MAX - record[kFirstBadAt];
    const int64_t f = feature_of(i, offsets, B_offsets, B_offsets ? 0 : num_bags / T, T);
    record[kBadId] = static_cast<int64_t>(indices[i]);
    record[kBadFeature] = f;
    record[kBadFeatureRows] = rows_per_table[f];
  }
  if (errors) merge(record, errors);
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
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
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

template <typename index_t, typename offset_t>
void launch_mark(const index_t* indices, const offset_t* offsets, int64_t num_bags, const int64_t* B_offsets,
                 int64_t T, const int64_t* hsc, const int64_t* rows_per_table, int64_t row_limit, ull* words,
                 int32_t* counts, int64_t num_indices, int64_t* record, int64_t* errors, cudaStream_t stream) {
  CNR_LAUNCH(check_lookup_kernel, blocks_for(num_bags + 1), kThreads, 0, stream)(
      offsets, num_bags, B_offsets, T, hsc, rows_per_table, row_limit, num_indices, record);
  if (num_bags > 0 && num_indices > 0) {
    CNR_LAUNCH(mark_rows_kernel, blocks_for(num_indices), kThreads, 0, stream)(
        indices, offsets, num_bags, B_offsets, T, hsc, rows_per_table, words, counts, num_indices, record);
  }
  CNR_LAUNCH(finish_record_kernel, 1, 1, 0, stream)(indices, offsets, num_bags, B_offsets, T, rows_per_table,
                                                     num_indices, record, errors);
}

template <typename index_t>
void launch_mark(const index_t* indices, const void* offsets, bool offsets_are_int64, int64_t num_bags,
                 const int64_t* B_offsets, int64_t T, const int64_t* hsc, const int64_t* rows_per_table,
                 int64_t row_limit, ull* words, int32_t* counts, int64_t num_indices, int64_t* record,
                 int64_t* errors, cudaStream_t stream) {
  if (offsets_are_int64) {
    launch_mark(indices, static_cast<const int64_t*>(offsets), num_bags, B_offsets, T, hsc, rows_per_table,
                row_limit, words, counts, num_indices, record, errors, stream);
  } else {
    launch_mark(indices, static_cast<const int32_t*>(offsets), num_bags, B_offsets, T, hsc, rows_per_table,
                row_limit, words, counts, num_indices, record, errors, stream);
  }
}

}  // namespace

void mark_rows(const void* indices, bool indices_are_int64, const void* offsets, bool offsets_are_int64,
               int64_t num_bags, const int64_t* B_offsets, int64_t num_features, const int64_t* hash_size_cumsum,
               const int64_t* rows_per_table, int64_t row_limit, unsigned long long* words, int32_t* counts,
               int64_t num_indices, int64_t* record, int64_t* errors, cudaStream_t stream) {
  if (indices_are_int64) {
    launch_mark(static_cast<const int64_t*>(indices), offsets, offsets_are_int64, num_bags, B_offsets, num_features,
                hash_size_cumsum, rows_per_table, row_limit, words, counts, num_indices, record, errors, stream);
  } else {
    launch_mark(static_cast<const int32_t*>(indices), offsets, offsets_are_int64, num_bags, B_offsets, num_features,
                hash_size_cumsum, rows_per_table, row_limit, words, counts, num_indices, record, errors, stream);
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
  CNR_LAUNCH(count_ranges_kernel, static_cast<unsigned>(num_ranges), kThreads, 0, stream)(words, boundaries, out);
}

void clear_range(unsigned long long* words, int64_t start, int64_t end, cudaStream_t stream) {
  if (start >= end) return;
  const int64_t nw = ((end - 1) >> 6) - (start >> 6) + 1;
  CNR_LAUNCH(clear_range_kernel, blocks_for(nw), kThreads, 0, stream)(words, start, end);
}

}  // namespace cnr::cuda
