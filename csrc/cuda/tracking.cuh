// Launchers of the CUDA dirty-row kernels. Plain pointers and a cudaStream_t only:
// this header and tracking.cu include no torch header, so nvcc can compile them
// on a machine whose torch is a CPU build. tracking_bind.cpp adapts them to torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cnr::cuda {

// Marks every looked-up row: id i of feature f is flat row hash_size_cumsum[f] + i,
// valid when i < rows_per_table[f] and the row is below row_limit; -1 (a pruned
// row) is skipped. B_offsets may be null (then each feature has num_bags / T
// bags). `invalid` points at three device int64s: the number of out-of-range
// ids, the smallest position of one (left untouched if none), and the number of
// bag offsets that are negative, decrease, or run past the indices.
void mark_rows(const void* indices, bool indices_are_int64, const void* offsets, bool offsets_are_int64,
               int64_t num_bags, const int64_t* B_offsets, int64_t num_features, const int64_t* hash_size_cumsum,
               const int64_t* rows_per_table, int64_t row_limit, unsigned long long* words, int32_t* counts,
               unsigned long long* invalid, int64_t num_indices, cudaStream_t stream);

// counts[w] = popcount of word w restricted to rows [start, end), for the words
// that range touches (first word = start / 64).
void popcount_words(const unsigned long long* words, int64_t start, int64_t end, int64_t* counts, cudaStream_t stream);

// Writes the ids of the set bits in [start, end); word_offsets is the exclusive
// scan of popcount_words' output.
void bits_to_rows(const unsigned long long* words, int64_t start, int64_t end, const int64_t* word_offsets,
                  int64_t* rows, cudaStream_t stream);

// out[r] = number of set bits in [boundaries[r], boundaries[r + 1]).
void count_ranges(const unsigned long long* words, const int64_t* boundaries, int64_t num_ranges, int64_t* out,
                  cudaStream_t stream);

// Clears the bits of rows [start, end).
void clear_range(unsigned long long* words, int64_t start, int64_t end, cudaStream_t stream);

}  // namespace cnr::cuda
