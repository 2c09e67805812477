// scatter_rows_ on CUDA: ATen's index_copy_ kernel already writes whole rows at
// memory speed there, so no kernel of our own (negative indices are dropped first). Compiled only in CUDA builds.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "device.h"

namespace cnr {
namespace {

void scatter_rows_cuda(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src) {
  TORCH_CHECK_VALUE(out.dim() == 2 && src.dim() == 2 && out.size(1) == src.size(1),
                    "cnr::scatter_rows_: out and src must be 2-D with equal columns, got ", out.sizes(), " and ",
                    src.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == src.scalar_type(), "cnr::scatter_rows_: out is ", out.scalar_type(),
                    " but src is ", src.scalar_type(), "; cast src first");
  TORCH_CHECK_VALUE(index.dim() == 1 && index.scalar_type() == at::kLong && index.numel() == src.size(0),
                    "cnr::scatter_rows_: index must be 1-D int64 with one entry per src row");
  auto idx = index.to(out.device());
  auto rows = src.to(out.device());
  const auto keep = idx.ge(0);  // a negative index skips its row
  if (!device::to_host(keep.all()).item<bool>()) {
    const auto sel = keep.nonzero().squeeze(1);
    rows = rows.index_select(0, sel);
    idx = idx.index_select(0, sel);
  }
  const_cast<at::Tensor&>(out).index_copy_(0, idx, rows);
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(CNR_DEVICE_LIB, CNR_DEVICE_KEY, m) { m.impl("scatter_rows_", &cnr::scatter_rows_cuda); }
