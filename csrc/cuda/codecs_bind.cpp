// Binds the CUDA row-codec launchers (codecs.cu) to the `cnr` ops, with the
// argument checks of codecs_checks.h that the CPU kernels use. Compiled in CUDA
// builds of torch and in the emulated build (see device.h). exhaustive_search,
// a measurement tool, stays CPU-only.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "device.h"

#include <cmath>

#include "../codecs_checks.h"
#include "codecs.cuh"

namespace cnr {
namespace {

using namespace codecs;

at::Tensor pack_bits_cuda(const at::Tensor& codes, int64_t bits) {
  const device::Guard guard(codes.device());
  const auto c = checked_codes(codes, bits);
  if (c.numel() > 0) check_largest_code(device::to_host(c.max()).item<uint8_t>(), bits);
  auto out = at::empty({c.size(0), packed_bytes(c.size(1), bits)}, c.options());
  cuda::pack_bits(c.data_ptr<uint8_t>(), c.size(0), c.size(1), static_cast<int>(bits), out.data_ptr<uint8_t>(),
                  device::stream());
  device::check_launch();
  return out;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed, int64_t bits, int64_t dim) {
  const device::Guard guard(packed.device());
  const auto p = checked_payload(packed, bits, dim, "unpack_bits", "packed");
  auto out = at::empty({p.size(0), dim}, p.options());
  cuda::unpack_bits(p.data_ptr<uint8_t>(), p.size(0), dim, static_cast<int>(bits), out.data_ptr<uint8_t>(),
                    device::stream());
  device::check_launch();
  return out;
}

std::tuple<at::Tensor, at::Tensor> cast_rows_cuda(const at::Tensor& rows, at::ScalarType dtype) {
  const device::Guard guard(rows.device());
  const auto x = checked_rows(rows, "cast_rows");
  check_cast_dtype(dtype);
  const int64_t n = x.size(0), dim = x.size(1);
  auto payload = at::empty({n, dim * static_cast<int64_t>(c10::elementSize(dtype))}, x.options().dtype(at::kByte));
  auto status = at::empty({n}, x.options().dtype(at::kByte));
  const int code = dtype == at::kFloat ? 0 : (dtype == at::kHalf ? 1 : 2);
  cuda::cast_rows(x.data_ptr<float>(), n, dim, code, payload.data_ptr<uint8_t>(), status.data_ptr<uint8_t>(),
                  device::stream());
  device::check_launch();
  return {payload, status};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_uniform_cuda(
    const at::Tensor& rows, int64_t bits, bool symmetric, at::ScalarType scale_dtype, at::ScalarType bias_dtype,
    const std::optional<at::Tensor>& grid_bias, const std::optional<at::Tensor>& grid_scale) {
  const device::Guard guard(rows.device());
  const auto x = checked_rows(rows, "quantize_uniform");
  check_bits(bits, "quantize_uniform");
  const bool scale_half = check_param_dtype(scale_dtype, "scale_dtype", "quantize_uniform");
  const bool bias_half = check_param_dtype(bias_dtype, "bias_dtype", "quantize_uniform");
  const auto [gb, gs] = checked_grid(grid_bias, grid_scale, x, symmetric, "quantize_uniform");
  const int64_t n = x.size(0), dim = x.size(1);
  auto payload = at::empty({n, packed_bytes(dim, bits)}, x.options().dtype(at::kByte));
  auto scale = at::empty({n}, x.options().dtype(scale_dtype));
  auto bias = at::empty({symmetric ? 0 : n}, x.options().dtype(bias_dtype));
  auto status = at::empty({n}, x.options().dtype(at::kByte));
  cuda::quantize_uniform(x.data_ptr<float>(), n, dim, static_cast<int>(bits), symmetric, scale_half, bias_half,
                         grid_bias ? gb.data_ptr<float>() : nullptr, grid_bias ? gs.data_ptr<float>() : nullptr,
                         payload.data_ptr<uint8_t>(), scale.data_ptr(), bias.data_ptr(), status.data_ptr<uint8_t>(),
                         device::stream());
  device::check_launch();
  return {payload, scale, bias, status};
}

at::Tensor dequantize_uniform_cuda(const at::Tensor& payload, const at::Tensor& scale,
                                   const std::optional<at::Tensor>& bias, int64_t bits, int64_t dim) {
  const device::Guard guard(payload.device());
  const auto p = checked_payload(payload, bits, dim, "dequantize_uniform");
  const int64_t n = p.size(0);
  const auto s = checked_params(scale, n, p, "scale", "dequantize_uniform");
  const auto b = bias ? checked_params(*bias, n, p, "bias", "dequantize_uniform") : at::Tensor();
  auto out = at::empty({n, dim}, p.options().dtype(at::kFloat));
  cuda::dequantize_uniform(p.data_ptr<uint8_t>(), n, dim, static_cast<int>(bits), s.data_ptr(),
                           s.scalar_type() == at::kHalf, bias ? b.data_ptr() : nullptr,
                           bias && b.scalar_type() == at::kHalf, out.data_ptr<float>(), device::stream());
  device::check_launch();
  return out;
}

// The positions of the kept entries (>= 0) of a host index, on `device`.
at::Tensor kept_positions(const at::Tensor& host_index, c10::Device device) {
  return (host_index >= 0).nonzero().squeeze(1).to(device);
}

// A restore reads its payload into host memory: it is moved to out's device, and
// decoded into a temporary that index_copy_ scatters (memory-bound on the GPU anyway).
void dequantize_uniform_into_cuda(const at::Tensor& payload, const at::Tensor& scale,
                                  const std::optional<at::Tensor>& bias, int64_t bits, const at::Tensor& rows,
                                  const at::Tensor& out, bool accumulate) {
  check_bits(bits, "dequantize_uniform_into_");
  check_into_out(out);
  const device::Guard guard(out.device());
  const auto dev = out.device();
  const auto p = checked_payload(payload.to(dev), bits, out.size(1), "dequantize_uniform_into_");
  const int64_t n = p.size(0);
  const auto s = checked_params(scale.to(dev), n, p, "scale", "dequantize_uniform_into_");
  const auto b = bias ? checked_params(bias->to(dev), n, p, "bias", "dequantize_uniform_into_") : at::Tensor();
  check_into_rows(rows, n);
  const auto host_rows = (rows.is_cpu() ? rows : device::to_host(rows)).contiguous();
  check_destinations(host_rows.data_ptr<int64_t>(), n, out.size(0), "dequantize_uniform_into_", "row");
  if (accumulate) {
    check_distinct_destinations(host_rows.data_ptr<int64_t>(), n, out.size(0), "dequantize_uniform_into_");
  }
  const auto keep = kept_positions(host_rows, dev);
  const auto decoded = dequantize_uniform_cuda(
      p.index_select(0, keep), s.index_select(0, keep),
      bias ? std::optional<at::Tensor>(b.index_select(0, keep)) : std::nullopt, bits, out.size(1));
  const auto dst = host_rows.to(dev).index_select(0, keep);
  if (accumulate) {
    const_cast<at::Tensor&>(out).index_add_(0, dst, decoded);  // distinct rows: one rounded add each, as on CPU
  } else {
    const_cast<at::Tensor&>(out).index_copy_(0, dst, decoded);
  }
}

std::tuple<at::Tensor, at::Tensor> adaptive_search_cuda(const at::Tensor& rows, int64_t bits, int64_t num_bins,
                                                        double ratio, int64_t refit_iters) {
  check_search(bits, num_bins, ratio, refit_iters, "adaptive_search");
  const device::Guard guard(rows.device());
  const auto x = checked_rows(rows, "adaptive_search");
  // Same move count as the CPU kernel (codecs_search.cpp).
  const int64_t rounds =
      std::min<int64_t>(num_bins - 1, static_cast<int64_t>(std::floor(num_bins * (1.0 - ratio) + 1e-9)) + 1);
  auto lo = at::empty({x.size(0)}, x.options());
  auto scale = at::empty({x.size(0)}, x.options());
  cuda::adaptive_search(x.data_ptr<float>(), x.size(0), x.size(1), static_cast<int>(bits), num_bins, rounds,
                        refit_iters, lo.data_ptr<float>(), scale.data_ptr<float>(), device::stream());
  device::check_launch();
  return {lo, scale};
}

// Two launches (search, then quantization on its grid): the same bytes as one fused pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> adaptive_quantize_cuda(
    const at::Tensor& rows, int64_t bits, int64_t num_bins, double ratio, int64_t refit_iters,
    at::ScalarType scale_dtype, at::ScalarType bias_dtype) {
  check_search(bits, num_bins, ratio, refit_iters, "adaptive_quantize");
  check_param_dtype(scale_dtype, "scale_dtype", "adaptive_quantize");
  check_param_dtype(bias_dtype, "bias_dtype", "adaptive_quantize");
  checked_rows(rows, "adaptive_quantize");
  const auto grid = adaptive_search_cuda(rows, bits, num_bins, ratio, refit_iters);
  return quantize_uniform_cuda(rows, bits, false, scale_dtype, bias_dtype, std::get<0>(grid), std::get<1>(grid));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kmeans_quantize_cuda(
    const at::Tensor& rows, int64_t bits, int64_t iters, at::ScalarType codebook_dtype,
    const std::optional<at::Tensor>& grid_bias, const std::optional<at::Tensor>& grid_scale) {
  const device::Guard guard(rows.device());
  const auto x = checked_rows(rows, "kmeans_quantize");
  check_kmeans(bits, iters, codebook_dtype);
  const bool half = codebook_dtype == at::kHalf;
  const auto [gb, gs] = checked_grid(grid_bias, grid_scale, x, /*symmetric=*/false, "kmeans_quantize");
  const int64_t n = x.size(0), dim = x.size(1), k = std::min<int64_t>(int64_t{1} << bits, dim);
  auto payload = at::empty({n, packed_bytes(dim, bits)}, x.options().dtype(at::kByte));
  auto bias = at::empty({n}, x.options());
  auto codebook = at::empty({n, k - 1}, x.options().dtype(codebook_dtype));
  auto status = at::empty({n}, x.options().dtype(at::kByte));
  cuda::kmeans_quantize(x.data_ptr<float>(), n, dim, static_cast<int>(bits), iters, half,
                        grid_bias ? gb.data_ptr<float>() : nullptr, grid_bias ? gs.data_ptr<float>() : nullptr,
                        payload.data_ptr<uint8_t>(), bias.data_ptr<float>(), codebook.data_ptr(),
                        status.data_ptr<uint8_t>(), device::stream());
  device::check_launch();
  return {payload, bias, codebook, status};
}

at::Tensor dequantize_codebook_cuda(const at::Tensor& payload, const at::Tensor& bias, const at::Tensor& codebook,
                                    int64_t bits, int64_t dim) {
  const device::Guard guard(payload.device());
  const auto p = checked_payload(payload, bits, dim, "dequantize_codebook");
  check_codebook(p, bias, codebook, bits);
  const int64_t n = p.size(0);
  const auto b = bias.contiguous();
  const auto cb = codebook.contiguous();
  auto out = at::empty({n, dim}, p.options().dtype(at::kFloat));
  auto bad = at::zeros({1}, p.options().dtype(at::kInt));
  cuda::dequantize_codebook(p.data_ptr<uint8_t>(), n, dim, static_cast<int>(bits), b.data_ptr<float>(), cb.data_ptr(),
                            cb.scalar_type() == at::kHalf, cb.size(1), out.data_ptr<float>(), bad.data_ptr<int>(),
                            device::stream());
  device::check_launch();
  // A restore's decode: one read on the host keeps a corrupt payload a hard error.
  check_codes_in_codebook(device::to_host(bad).item<int>() != 0, cb.size(1));
  return out;
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(CNR_DEVICE_LIB, CNR_DEVICE_KEY, m) {
  m.impl("pack_bits", &cnr::pack_bits_cuda);
  m.impl("unpack_bits", &cnr::unpack_bits_cuda);
  m.impl("cast_rows", &cnr::cast_rows_cuda);
  m.impl("quantize_uniform", &cnr::quantize_uniform_cuda);
  m.impl("dequantize_uniform", &cnr::dequantize_uniform_cuda);
  m.impl("dequantize_uniform_into_", &cnr::dequantize_uniform_into_cuda);
  m.impl("adaptive_search", &cnr::adaptive_search_cuda);
  m.impl("adaptive_quantize", &cnr::adaptive_quantize_cuda);
  m.impl("kmeans_quantize", &cnr::kmeans_quantize_cuda);
  m.impl("dequantize_codebook", &cnr::dequantize_codebook_cuda);
}
