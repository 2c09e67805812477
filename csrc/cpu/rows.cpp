// CPU kernels of restore's row ops.
// scatter_rows_: out[index[i]] = src[i] for whole rows, one memcpy per row.
// Restore writes every decoded row into a TBE weight (or optimizer-state) view
// this way; ATen's index_copy_ walks the same rows element by element and was
// 7-8x slower on 32-wide float rows.
// claim_rows_: which stored rows of a checkpoint entry a shard still needs, and
// where they go, in one pass (restore applies the chain newest first).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../codecs_checks.h"

namespace cnr {
namespace {

// Rows i in [i0, i1) of src to out rows index[i] (negative: skipped); kBytes = 0: `bytes` a row.
// Fixed-size rows go without a branch: a skipped row is written to a scratch slot instead.
template <int64_t kBytes>
void copy_rows(char* out, const char* src, const int64_t* index, int64_t out_stride, int64_t i0, int64_t i1,
               int64_t bytes = kBytes) {
  if constexpr (kBytes > 0) {
    alignas(16) char scratch[kBytes];
    for (int64_t i = i0; i < i1; ++i) {
      char* dst = index[i] >= 0 ? out + index[i] * out_stride : scratch;
      std::memcpy(dst, src + i * kBytes, kBytes);
    }
  } else {
    for (int64_t i = i0; i < i1; ++i) {
      if (index[i] >= 0) std::memcpy(out + index[i] * out_stride, src + i * bytes, bytes);
    }
  }
}

void scatter_rows_cpu(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src) {
  codecs::check_scatter(out, index, src);
  const auto idx = index.contiguous();
  const auto s = src.contiguous();
  const int64_t n = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  codecs::check_destinations(ip, n, out.size(0), "scatter_rows_", "index");  // before anything is written
  if (n == 0 || out.size(1) == 0) return;
  const int64_t item = out.element_size();
  const int64_t row_bytes = out.size(1) * item, out_stride = out.stride(0) * item;
  char* op = static_cast<char*>(out.data_ptr());
  const char* sp = static_cast<const char*>(s.data_ptr());
  at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
    switch (row_bytes) {  // one value a row (row-wise optimizer state): a fixed-size copy, no memcpy call
      case 4: return copy_rows<4>(op, sp, ip, out_stride, i0, i1);
      case 8: return copy_rows<8>(op, sp, ip, out_stride, i0, i1);
      default: return copy_rows<0>(op, sp, ip, out_stride, i0, i1, row_bytes);
    }
  });
}

at::Tensor claim_rows_cpu(const at::Tensor& filled, const std::optional<at::Tensor>& offsets, int64_t count,
                          int64_t lo, int64_t hi, int64_t shift) {
  TORCH_CHECK_VALUE(filled.dim() == 1 && filled.scalar_type() == at::kBool && filled.is_contiguous(),
                    "cnr::claim_rows_: filled must be a contiguous 1-D bool tensor, got ", filled.scalar_type(), " ",
                    filled.sizes());
  TORCH_CHECK_VALUE(count >= 0, "cnr::claim_rows_: count must be >= 0, got ", count);
  at::Tensor offs;
  if (offsets) {
    TORCH_CHECK_VALUE(offsets->dim() == 1 && offsets->scalar_type() == at::kLong && offsets->numel() == count,
                      "cnr::claim_rows_: offsets must be 1-D int64 with `count` (", count, ") entries, got ",
                      offsets->scalar_type(), " ", offsets->sizes());
    offs = offsets->contiguous();
  }
  const int64_t* op = offsets ? offs.data_ptr<int64_t>() : nullptr;
  const int64_t rows = filled.numel();
  lo = std::max<int64_t>(lo, 0);
  auto map = at::empty({count}, filled.options().dtype(at::kLong));
  int64_t* mp = map.data_ptr<int64_t>();
  bool* fp = filled.data_ptr<bool>();
  // One pass; the only data-dependent choice (already filled or not) is a select, not a branch.
  for (int64_t p = 0; p < count; ++p) {
    const int64_t o = op ? op[p] : p;
    if (o < lo || o >= hi) {
      mp[p] = -1;
      continue;
    }
    const int64_t dst = o + shift;
    if (static_cast<uint64_t>(dst) >= static_cast<uint64_t>(rows)) {
      for (int64_t q = 0; q < p; ++q) {  // give back what this call claimed: nothing changes on an error
        if (mp[q] >= 0) fp[mp[q]] = false;
      }
      TORCH_CHECK_INDEX(false, "cnr::claim_rows_: stored row ", p, " (entry row ", o, ") lands on row ", dst,
                        ", outside the ", rows, " rows of filled");
    }
    const bool was = fp[dst];
    fp[dst] = true;
    mp[p] = was ? -1 : dst;
  }
  return map;
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(cnr, CPU, m) {
  m.impl("scatter_rows_", &cnr::scatter_rows_cpu);
  m.impl("claim_rows_", &cnr::claim_rows_cpu);
}
