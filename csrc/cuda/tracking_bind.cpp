// Binds the CUDA dirty-row launchers (tracking.cu) to the `cnr` ops. Compiled
// only when torch is a CUDA build (setup.py adds csrc/cuda/*_bind.cpp then).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "device.h"

#include "../tracking_checks.h"
#include "tracking.cuh"

namespace cnr {
namespace {

unsigned long long* words_of(const at::Tensor& bitmap) {
  TORCH_CHECK(bitmap.dtype() == at::kLong && bitmap.dim() == 1 && bitmap.is_contiguous(),
              "cnr: bitmap must be a contiguous 1-D int64 tensor of packed words");
  return reinterpret_cast<unsigned long long*>(bitmap.data_ptr<int64_t>());
}

void mark_rows_cuda(const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& hash_size_cumsum,
                    const at::Tensor& rows_per_table, const at::Tensor& bitmap, const std::optional<at::Tensor>& counts,
                    const std::optional<at::Tensor>& B_offsets) {
  const MarkRowsShape shape =
      check_mark_rows_args(indices, offsets, hash_size_cumsum, rows_per_table, bitmap, counts, B_offsets);
  const device::Guard guard(bitmap.device());
  const auto stream = device::stream();
  const auto idx = indices.contiguous();
  const auto off = offsets.contiguous();
  const auto hsc = hash_size_cumsum.to(bitmap.device()).contiguous();
  const auto rows = rows_per_table.to(bitmap.device()).contiguous();
  const int64_t T = shape.num_features, num_bags = shape.num_bags;
  std::optional<at::Tensor> b;
  if (B_offsets) b = B_offsets->to(bitmap.device(), at::kLong).contiguous();
  if (num_bags <= 0 || idx.numel() == 0) return;
  TORCH_CHECK(b || num_bags % T == 0, "cnr::mark_rows: offsets has ", num_bags, " bags, not a multiple of the ", T,
              " features; pass B_offsets for variable batch sizes");
  auto invalid = at::zeros({3}, bitmap.options());
  invalid.select(0, 1).fill_(INT64_MAX);
  cuda::mark_rows(idx.data_ptr(), idx.scalar_type() == at::kLong, off.data_ptr(), off.scalar_type() == at::kLong,
                  num_bags, b ? b->data_ptr<int64_t>() : nullptr, T, hsc.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
                  shape.row_limit, words_of(bitmap), counts ? counts->data_ptr<int32_t>() : nullptr,
                  reinterpret_cast<unsigned long long*>(invalid.data_ptr<int64_t>()), idx.numel(), stream);
  device::check_launch();
  // One small device-to-host copy per lookup keeps out-of-range ids a hard error.
  const auto host = device::to_host(invalid);
  const int64_t* h = host.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(h[2] == 0, "cnr::mark_rows: ", h[2], " bag offsets are negative, decrease, or run past the ",
                    idx.numel(), " indices; bag offsets must never decrease");
  TORCH_CHECK_INDEX(h[0] == 0, "cnr::mark_rows: ", h[0], " looked-up ids are outside their tables (first at position ",
                    h[1], "); check the input ids against num_embeddings");
}

at::Tensor bitmap_to_rows_cuda(const at::Tensor& bitmap, int64_t start, int64_t end) {
  const device::Guard guard(bitmap.device());
  const auto stream = device::stream();
  TORCH_CHECK(0 <= start && start <= end && end <= bitmap.numel() * 64, "cnr::bitmap_to_rows: bad row range");
  if (start == end) return at::empty({0}, bitmap.options());
  const int64_t nw = ((end - 1) >> 6) - (start >> 6) + 1;
  auto per_word = at::empty({nw}, bitmap.options());
  cuda::popcount_words(words_of(bitmap), start, end, per_word.data_ptr<int64_t>(), stream);
  auto inclusive = per_word.cumsum(0);
  const int64_t total = device::to_host(inclusive[-1]).item<int64_t>();
  auto exclusive = inclusive - per_word;
  auto rows = at::empty({total}, bitmap.options());
  cuda::bits_to_rows(words_of(bitmap), start, end, exclusive.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), stream);
  device::check_launch();
  return rows;
}

at::Tensor bitmap_count_cuda(const at::Tensor& bitmap, const at::Tensor& boundaries) {
  const device::Guard guard(bitmap.device());
  const auto b = boundaries.to(bitmap.device(), at::kLong).contiguous();
  const int64_t R = std::max<int64_t>(b.numel() - 1, 0);
  auto out = at::empty({R}, bitmap.options());
  cuda::count_ranges(words_of(bitmap), b.data_ptr<int64_t>(), R, out.data_ptr<int64_t>(),
                     device::stream());
  device::check_launch();
  return out;
}

void bitmap_clear_cuda(const at::Tensor& bitmap, int64_t start, int64_t end) {
  const device::Guard guard(bitmap.device());
  TORCH_CHECK(0 <= start && start <= end && end <= bitmap.numel() * 64, "cnr::bitmap_clear_: bad row range");
  cuda::clear_range(words_of(bitmap), start, end, device::stream());
  device::check_launch();
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(CNR_DEVICE_LIB, CNR_DEVICE_KEY, m) {
  m.impl("mark_rows", &cnr::mark_rows_cuda);
  m.impl("bitmap_to_rows", &cnr::bitmap_to_rows_cuda);
  m.impl("bitmap_count", &cnr::bitmap_count_cuda);
  m.impl("bitmap_clear_", &cnr::bitmap_clear_cuda);
}
