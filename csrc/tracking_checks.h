// Argument checks of cnr::mark_rows, shared by the CPU kernel and the CUDA
// binding so that both backends accept and reject the same calls. Only shapes
// and dtypes are read here: nothing is copied from the device.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <climits>
#include <optional>

namespace cnr {

struct MarkRowsShape {
  int64_t num_features;  // T: entries of rows_per_table, one per feature
  int64_t num_bags;      // offsets.numel() - 1
  int64_t row_limit;     // flat rows the bitmap (and counts, if given) can hold
};

inline MarkRowsShape check_mark_rows_args(const at::Tensor& indices, const at::Tensor& offsets,
                                          const at::Tensor& hash_size_cumsum, const at::Tensor& rows_per_table,
                                          const at::Tensor& bitmap, const std::optional<at::Tensor>& counts,
                                          const std::optional<at::Tensor>& B_offsets) {
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
    TORCH_CHECK(counts->device() == bitmap.device(), "cnr::mark_rows: counts and bitmap must be on one device");
    row_limit = std::min(row_limit, counts->numel());
  }
  if (B_offsets) {
    TORCH_CHECK(B_offsets->dim() == 1 && B_offsets->numel() == T + 1, "cnr::mark_rows: B_offsets needs ", T + 1,
                " entries (one per feature plus one), got ", B_offsets->numel());
  }
  return {T, offsets.numel() - 1, row_limit};
}

}  // namespace cnr
