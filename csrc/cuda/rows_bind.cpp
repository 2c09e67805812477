// scatter_rows_ on CUDA: ATen's index_copy_ kernel already writes whole rows at
// memory speed there, so there is no kernel of our own. The checks are the CPU
// kernel's (codecs_checks.h), made before anything is written: the index is read
// on the host (a restore's index is made there), negative entries are dropped.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "device.h"

#include "../codecs_checks.h"

namespace cnr {
namespace {

void scatter_rows_cuda(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src) {
  codecs::check_scatter(out, index, src);
  const device::Guard guard(out.device());
  const auto host_index = (index.is_cpu() ? index : device::to_host(index)).contiguous();
  codecs::check_destinations(host_index.data_ptr<int64_t>(), host_index.numel(), out.size(0), "scatter_rows_",
                             "index");
  const auto keep = (host_index >= 0).nonzero().squeeze(1);
  const auto rows = src.index_select(0, keep.to(src.device())).to(out.device());
  const_cast<at::Tensor&>(out).index_copy_(0, host_index.index_select(0, keep).to(out.device()), rows);
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(CNR_DEVICE_LIB, CNR_DEVICE_KEY, m) { m.impl("scatter_rows_", &cnr::scatter_rows_cuda); }
