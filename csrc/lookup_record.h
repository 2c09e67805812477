// The record of one or more cnr::mark_rows calls: what was wrong with a lookup.
// Plain C++ with no torch header, so that the CUDA kernels (tracking.cu) fill it
// on the device exactly as the CPU kernel fills it on the host; the checks and
// the one formatter that raises from it are in tracking_checks.h.
//
// "First" positions are stored as INT64_MAX - p, so that a zeroed record means
// "none" and an atomic max keeps the first one.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(CNR_CUDA_EMU)
#define CNR_HOST_DEVICE __host__ __device__
#else
#define CNR_HOST_DEVICE
#endif

namespace cnr::lookup_record {

enum Slot : int64_t {
  kBadTables = 0,    // features whose [hash_size_cumsum, + rows_per_table) is negative or past the bitmap
  kFirstBadTable,    // INT64_MAX - the first such feature
  kTableStart,       //   its hash_size_cumsum entry
  kTableRows,        //   its rows_per_table entry
  kRowLimit,         //   rows the bitmap (and counts) hold
  kBadBatchOffsets,  // B_offsets entries out of order (must start at 0, never decrease, end at the bags)
  kBadBags,          // bag boundaries b in [0, num_bags] that are negative, decrease, or run past the ids
  kFirstBadBag,      // INT64_MAX - the first such b
  kBagStart,         //   offsets[b]
  kBagEnd,           //   offsets[b + 1] (b < num_bags)
  kNumBags,          // the lookup's bags
  kNumIndices,       // the lookup's ids
  kBadIds,           // ids outside their table (other than -1)
  kFirstBadAt,       // INT64_MAX - the position of the first one
  kBadId,            //   that id
  kBadFeature,       //   its feature
  kBadFeatureRows,   //   its table's rows
  kSize
};

// Whether a record stops the lookup before anything is marked.
CNR_HOST_DEVICE inline bool stops_lookup(const int64_t* r) {
  return r[kBadTables] > 0 || r[kBadBatchOffsets] > 0 || r[kBadBags] > 0;
}

CNR_HOST_DEVICE inline bool has_problem(const int64_t* r) { return stops_lookup(r) || r[kBadIds] > 0; }

// Folds one call's record into an accumulated one: the counts add up, and the
// details stay those of the first call that had a problem.
CNR_HOST_DEVICE inline void merge(const int64_t* call, int64_t* acc) {
  if (!has_problem(call)) return;
  const bool first = !has_problem(acc);
  for (int s = 0; s < kSize; ++s) {
    const bool count = s == kBadTables || s == kBadBatchOffsets || s == kBadBags || s == kBadIds;
    if (count) {
      acc[s] += call[s];
    } else if (first) {
      acc[s] = call[s];
    }
  }
}

}  // namespace cnr::lookup_record
