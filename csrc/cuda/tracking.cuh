// Launchers of the CUDA dirty-row kernels. Plain pointers and a cudaStream_t only:
// this header and tracking.cu include no torch header, so nvcc can compile them
// on a machine whose torch is a CPU build. tracking_bind.cpp adapts them to torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cnr::cuda {

// Checks one lookup and marks its rows, filling `record` (int64 [lookup_record::kSize]
// on the device, zeroed; see csrc/lookup_record.h) exactly as the CPU kernel
// does: the TBE's row layout (feature f's table is rows [hash_size_cumsum[f],
// + rows_per_table[f]) of the row_limit the bitmap holds), B_offsets, and the bag
// offsets are checked first and stop the lookup; then id i of feature f marks
// flat row hash_size_cumsum[f] + i, an id outside its table is recorded and
// skipped, and -1 (a pruned row) is skipped. B_offsets may be null (then each
// feature has num_bags / T bags). When `errors` is not null, the record is then
// folded into it (lookup_record::merge). Nothing is read back on the host.
void mark_rows(const void* indices, bool indices_are_int64, const void* offsets, bool offsets_are_int64,
               int64_t num_bags, const int64_t* B_offsets, int64_t num_features, const int64_t* hash_size_cumsum,
               const int64_t* rows_per_table, int64_t row_limit, unsigned long long* words, int32_t* counts,
               int64_t num_indices, int64_t* record, int64_t* errors, cudaStream_t stream);

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
