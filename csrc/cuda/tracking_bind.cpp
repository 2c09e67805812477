// Binds the CUDA dirty-row launchers (tracking.cu) to the `cnr` ops, with the
// checks of tracking_checks.h that the CPU kernels use. Compiled in CUDA builds
// of torch, and in the emulated build (see device.h).
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "device.h"

#include "../tracking_checks.h"
#include "tracking.cuh"

namespace cnr {
namespace {

unsigned long long* words_of(const at::Tensor& bitmap) {
  return reinterpret_cast<unsigned long long*>(bitmap.data_ptr<int64_t>());
}

void mark_rows_cuda(const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& hash_size_cumsum,
                    const at::Tensor& rows_per_table, const at::Tensor& bitmap, const std::optional<at::Tensor>& counts,
                    const std::optional<at::Tensor>& B_offsets, const std::optional<at::Tensor>& errors) {
  const MarkRowsShape shape =
      check_mark_rows_args(indices, offsets, hash_size_cumsum, rows_per_table, bitmap, counts, B_offsets, errors);
  const device::Guard guard(bitmap.device());
  const auto idx = indices.contiguous();
  const auto off = offsets.contiguous();
  const auto hsc = hash_size_cumsum.contiguous();
  const auto rows = rows_per_table.contiguous();
  const auto b = B_offsets ? B_offsets->contiguous() : at::Tensor();
  // This call's record; with `errors` it stays on the device, folded into it.
  auto record = at::zeros({kLookupRecordSize}, bitmap.options());
  cuda::mark_rows(idx.data_ptr(), idx.scalar_type() == at::kLong, off.data_ptr(), off.scalar_type() == at::kLong,
                  shape.num_bags, B_offsets ? b.data_ptr<int64_t>() : nullptr, shape.num_features,
                  hsc.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), shape.row_limit, words_of(bitmap),
                  counts ? counts->data_ptr<int32_t>() : nullptr, idx.numel(), record.data_ptr<int64_t>(),
                  errors ? errors->data_ptr<int64_t>() : nullptr, device::stream());
  device::check_launch();
  if (!errors) raise_lookup_errors(device::to_host(record).data_ptr<int64_t>());
}

void raise_lookup_errors_cuda(const at::Tensor& errors) {
  TORCH_CHECK(errors.dtype() == at::kLong && errors.numel() == kLookupRecordSize,
              "cnr::raise_lookup_errors: errors must be the int64 record of ", kLookupRecordSize,
              " entries that mark_rows filled");
  raise_lookup_errors(device::to_host(errors.contiguous()).data_ptr<int64_t>());
}

at::Tensor bitmap_to_rows_cuda(const at::Tensor& bitmap, int64_t start, int64_t end) {
  check_bitmap(bitmap, "bitmap_to_rows");
  check_range(bitmap, start, end, "bitmap_to_rows");
  const device::Guard guard(bitmap.device());
  if (start == end) return at::empty({0}, bitmap.options());
  const int64_t nw = ((end - 1) >> 6) - (start >> 6) + 1;
  auto per_word = at::empty({nw}, bitmap.options());
  cuda::popcount_words(words_of(bitmap), start, end, per_word.data_ptr<int64_t>(), device::stream());
  auto inclusive = per_word.cumsum(0);
  // The output's size is the number of set bits: one read on the host.
  const int64_t total = device::to_host(inclusive[-1]).item<int64_t>();
  auto exclusive = inclusive - per_word;
  auto rows = at::empty({total}, bitmap.options());
  cuda::bits_to_rows(words_of(bitmap), start, end, exclusive.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
                     device::stream());
  device::check_launch();
  return rows;
}

// Boundaries are checked on the host, where callers keep them: a device tensor is read back once.
at::Tensor bitmap_count_cuda(const at::Tensor& bitmap, const at::Tensor& boundaries) {
  const auto host = (boundaries.is_cpu() ? boundaries : device::to_host(boundaries)).to(at::kLong).contiguous();
  check_count_ranges(bitmap, host);
  const device::Guard guard(bitmap.device());
  const auto b = host.to(bitmap.device());
  const int64_t R = std::max<int64_t>(b.numel() - 1, 0);
  auto out = at::empty({R}, bitmap.options());
  cuda::count_ranges(words_of(bitmap), b.data_ptr<int64_t>(), R, out.data_ptr<int64_t>(), device::stream());
  device::check_launch();
  return out;
}

void bitmap_clear_cuda(const at::Tensor& bitmap, int64_t start, int64_t end) {
  check_bitmap(bitmap, "bitmap_clear_");
  check_range(bitmap, start, end, "bitmap_clear_");
  const device::Guard guard(bitmap.device());
  cuda::clear_range(words_of(bitmap), start, end, device::stream());
  device::check_launch();
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(CNR_DEVICE_LIB, CNR_DEVICE_KEY, m) {
  m.impl("mark_rows", &cnr::mark_rows_cuda);
  m.impl("raise_lookup_errors", &cnr::raise_lookup_errors_cuda);
  m.impl("bitmap_to_rows", &cnr::bitmap_to_rows_cuda);
  m.impl("bitmap_count", &cnr::bitmap_count_cuda);
  m.impl("bitmap_clear_", &cnr::bitmap_clear_cuda);
}
