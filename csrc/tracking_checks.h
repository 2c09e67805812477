// The checks of cnr::mark_rows, shared by the CPU kernel and the CUDA binding so
// that both backends accept and reject the same calls with the same messages.
//
// Two kinds of check:
// - check_mark_rows_args() reads shapes, dtypes and devices only (nothing is
//   copied from a device) and raises at once;
// - the values (the TBE's row layout, B_offsets, the bag offsets and the ids)
//   are checked by each backend's kernel, which fills a record (lookup_record.h): counts of
//   each kind of problem plus the details of the first one. The CPU raises from
//   that record right away; on CUDA it stays on the device when the caller passes
//   an `errors` record (no host sync per lookup) and raise_lookup_errors() reads
//   it later. One formatter, here, turns a record into the exception.
//
// Problems are ranked: a bad row layout, then bad B_offsets, then a bad bag
// layout stop the lookup before any row is marked; bad ids are skipped one by
// one (the other ids are marked). An id of -1 is a pruned row and no problem.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "lookup_record.h"

namespace cnr {

constexpr int64_t kLookupRecordSize = lookup_record::kSize;

// Raises the highest-ranked problem of a host record; returns if there is none.
inline void raise_lookup_errors(const int64_t* r) {
  using namespace lookup_record;
  if (r[kBadTables] > 0) {
    TORCH_CHECK(false, "cnr::mark_rows: feature ", INT64_MAX - r[kFirstBadTable], "'s table spans rows [",
                r[kTableStart], ", ", r[kTableStart] + r[kTableRows], ") but the bitmap holds ", r[kRowLimit],
                " rows (with counts: the smaller of the two); pass the TBE's own hash_size_cumsum and rows_per_table");
  }
  TORCH_CHECK(r[kBadBatchOffsets] == 0, "cnr::mark_rows: B_offsets must start at 0, never decrease, and end at the ",
              r[kNumBags], " bags of offsets; ", r[kBadBatchOffsets], " entries do not");
  if (r[kBadBags] > 0) {
    const int64_t b = INT64_MAX - r[kFirstBadBag];
    TORCH_CHECK_VALUE(!(b == 0 && r[kBagStart] < 0), "cnr::mark_rows: offsets start at ", r[kBagStart],
                      "; bag offsets must be non-negative");
    TORCH_CHECK_VALUE(b == r[kNumBags], "cnr::mark_rows: offsets decrease at bag ", b, " (", r[kBagStart], " then ",
                      r[kBagEnd], "); bag offsets must never decrease");
    TORCH_CHECK_VALUE(false, "cnr::mark_rows: offsets end at ", r[kBagStart], " but there are only ",
                      r[kNumIndices], " indices");
  }
  TORCH_CHECK_INDEX(r[kBadIds] == 0, "cnr::mark_rows: id ", r[kBadId], " looked up in feature ", r[kBadFeature],
                    " is outside its table's ", r[kBadFeatureRows], " local rows (", r[kBadIds],
                    " bad ids); check the input ids against the table's num_embeddings");
}

struct MarkRowsShape {
  int64_t num_features;  // T: entries of rows_per_table, one per feature
  int64_t num_bags;      // offsets.numel() - 1
  int64_t row_limit;     // flat rows the bitmap (and counts, if given) can hold
};

inline MarkRowsShape check_mark_rows_args(const at::Tensor& indices, const at::Tensor& offsets,
                                          const at::Tensor& hash_size_cumsum, const at::Tensor& rows_per_table,
                                          const at::Tensor& bitmap, const std::optional<at::Tensor>& counts,
                                          const std::optional<at::Tensor>& B_offsets,
                                          const std::optional<at::Tensor>& errors) {
  TORCH_CHECK(bitmap.dtype() == at::kLong && bitmap.dim() == 1 && bitmap.is_contiguous(),
              "cnr::mark_rows: bitmap must be a contiguous 1-D int64 tensor of packed words, got ", bitmap.dtype(),
              " ", bitmap.sizes());
  TORCH_CHECK(indices.dim() == 1 && offsets.dim() == 1, "cnr::mark_rows: indices and offsets must be 1-D");
  TORCH_CHECK(offsets.numel() >= 1, "cnr::mark_rows: offsets needs at least one entry (the start of the first bag)");
  const auto is_index = [](const at::Tensor& t) { return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong; };
  TORCH_CHECK(is_index(indices) && is_index(offsets), "cnr::mark_rows: indices and offsets must be int32 or int64, got ",
              indices.scalar_type(), " and ", offsets.scalar_type());
  TORCH_CHECK(rows_per_table.dtype() == at::kLong && rows_per_table.dim() == 1 && rows_per_table.numel() >= 1,
              "cnr::mark_rows: rows_per_table must be a 1-D int64 tensor with one entry per feature (FBGEMM's "
              "TBE.rows_per_table)");
  const int64_t T = rows_per_table.numel();
  TORCH_CHECK(hash_size_cumsum.dtype() == at::kLong && hash_size_cumsum.dim() == 1 && hash_size_cumsum.numel() == T + 1,
              "cnr::mark_rows: hash_size_cumsum must be a 1-D int64 tensor with one entry per feature plus one (",
              T + 1, "), got ", hash_size_cumsum.sizes());
  int64_t row_limit = bitmap.numel() * 64;
  if (counts) {
    TORCH_CHECK(counts->dtype() == at::kInt && counts->dim() == 1 && counts->is_contiguous(),
                "cnr::mark_rows: counts must be a contiguous 1-D int32 tensor with one entry per row");
    row_limit = std::min(row_limit, counts->numel());
  }
  const int64_t num_bags = offsets.numel() - 1;
  if (B_offsets) {
    TORCH_CHECK(B_offsets->dtype() == at::kLong && B_offsets->dim() == 1 && B_offsets->numel() == T + 1,
                "cnr::mark_rows: B_offsets must be a 1-D int64 tensor with one entry per feature plus one (", T + 1,
                "), got ", B_offsets->scalar_type(), " ", B_offsets->sizes());
  } else {
    TORCH_CHECK(num_bags % T == 0, "cnr::mark_rows: offsets has ", num_bags, " bags, not a multiple of the ", T,
                " features; pass B_offsets for variable batch sizes");
  }
  if (errors) {
    TORCH_CHECK(errors->dtype() == at::kLong && errors->dim() == 1 && errors->numel() == kLookupRecordSize &&
                    errors->is_contiguous(),
                "cnr::mark_rows: errors must be a contiguous int64 tensor of ", kLookupRecordSize,
                " zeros (see cnr_torchrec.ops.lookup_record)");
  }
  // Every tensor on the bitmap's device: the kernel reads them all there, and a
  // hidden copy per lookup would cost a host sync on CUDA.
  const auto same_device = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device() == bitmap.device(), "cnr::mark_rows: ", what, " is on ", t.device(), " but the bitmap on ",
                bitmap.device(), "; keep every argument on the bitmap's device");
  };
  same_device(indices, "indices");
  same_device(offsets, "offsets");
  same_device(hash_size_cumsum, "hash_size_cumsum");
  same_device(rows_per_table, "rows_per_table");
  if (counts) same_device(*counts, "counts");
  if (B_offsets) same_device(*B_offsets, "B_offsets");
  if (errors) same_device(*errors, "errors");
  return {T, num_bags, row_limit};
}

// ---- bitmap_to_rows, bitmap_count, bitmap_clear_ -----------------------------

inline void check_bitmap(const at::Tensor& bitmap, const char* op) {
  TORCH_CHECK(bitmap.dtype() == at::kLong && bitmap.dim() == 1 && bitmap.is_contiguous(), "cnr::", op,
              ": bitmap must be a contiguous 1-D int64 tensor of packed words, got ", bitmap.dtype(), " ",
              bitmap.sizes());
}

inline void check_range(const at::Tensor& bitmap, int64_t start, int64_t end, const char* op) {
  TORCH_CHECK(0 <= start && start <= end && end <= bitmap.numel() * 64, "cnr::", op, ": row range [", start, ", ",
              end, ") is outside the bitmap's ", bitmap.numel() * 64, " rows");
}

// bitmap_count's boundaries, given on the host: every range inside the bitmap.
inline void check_count_ranges(const at::Tensor& bitmap, const at::Tensor& host_boundaries) {
  check_bitmap(bitmap, "bitmap_count");
  TORCH_CHECK(host_boundaries.dim() == 1 && host_boundaries.scalar_type() == at::kLong && host_boundaries.is_cpu(),
              "cnr::bitmap_count: boundaries must be a 1-D int64 tensor");
  const int64_t* b = host_boundaries.data_ptr<int64_t>();
  for (int64_t r = 0; r + 1 < host_boundaries.numel(); ++r) check_range(bitmap, b[r], b[r + 1], "bitmap_count");
}

}  // namespace cnr
