// Binds the CUDA row-codec launchers (codecs.cu) to the `cnr` ops. Compiled only
// when torch is a CUDA build (setup.py adds csrc/cuda/*_bind.cpp then). The
// argument checks mirror the CPU kernels'; exhaustive_search stays CPU-only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "device.h"

#include <cmath>

#include "codecs.cuh"

namespace cnr {
namespace {

int64_t packed_bytes(int64_t dim, int64_t bits) { return (dim * bits + 7) / 8; }

void check_bits(int64_t bits, const char* op) {
  TORCH_CHECK_VALUE(bits == 2 || bits == 3 || bits == 4 || bits == 8, "cnr::", op, ": bits must be 2, 3, 4 or 8, got ",
                    bits);
}

at::Tensor checked_rows(const at::Tensor& rows, const char* op) {
  TORCH_CHECK_VALUE(rows.dim() == 2, "cnr::", op, ": rows must be 2-D [N, D], got ", rows.dim(), "-D");
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kFloat, "cnr::", op, ": rows must be float32, got ", rows.scalar_type());
  TORCH_CHECK_VALUE(rows.size(1) > 0, "cnr::", op, ": rows must have at least one column");
  return rows.contiguous();
}

bool is_half(at::ScalarType dtype, const char* what, const char* op) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf, "cnr::", op, ": ", what,
                    " must be float32 or float16, got ", dtype);
  return dtype == at::kHalf;
}

at::Tensor checked_payload(const at::Tensor& payload, int64_t bits, int64_t dim, const char* op) {
  TORCH_CHECK_VALUE(payload.dim() == 2 && payload.scalar_type() == at::kByte, "cnr::", op,
                    ": payload must be a 2-D uint8 tensor");
  TORCH_CHECK_VALUE(dim >= 1 && payload.size(1) == packed_bytes(dim, bits), "cnr::", op, ": ", dim, " codes of ", bits,
                    " bits need rows of ", packed_bytes(dim, bits), " bytes, got ", payload.size(1));
  return payload.contiguous();
}

at::Tensor checked_params(const at::Tensor& t, int64_t n, const at::Tensor& like, const char* what, const char* op) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
                    "cnr::", op, ": ", what, " must be a float32 or float16 vector with one entry per row (", n,
                    "), got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == like.device(), "cnr::", op, ": ", what, " is on ", t.device(), ", the payload on ",
                    like.device());
  return t.contiguous();
}

at::Tensor pack_bits_cuda(const at::Tensor& codes, int64_t bits) {
  check_bits(bits, "pack_bits");
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.scalar_type() == at::kByte,
                    "cnr::pack_bits: codes must be a 2-D uint8 tensor");
  const device::Guard guard(codes.device());
  const auto c = codes.contiguous();
  if (c.numel() > 0) {
    TORCH_CHECK_VALUE(device::to_host(c.max()).item<uint8_t>() < (1 << bits), "cnr::pack_bits: codes must be below 2**bits = ",
                      1 << bits);
  }
  auto out = at::empty({c.size(0), packed_bytes(c.size(1), bits)}, c.options());
  cuda::pack_bits(c.data_ptr<uint8_t>(), c.size(0), c.size(1), static_cast<int>(bits), out.data_ptr<uint8_t>(),
                  device::stream());
  device::check_launch();
  return out;
}

at::Tensor unpack_bits_cuda(const at::Tensor& packed, int64_t bits, int64_t dim) {
  check_bits(bits, "unpack_bits");
  const device::Guard guard(packed.device());
  const auto p = checked_payload(packed, bits, dim, "unpack_bits");
  auto out = at::empty({p.size(0), dim}, p.options());
  cuda::unpack_bits(p.data_ptr<uint8_t>(), p.size(0), dim, static_cast<int>(bits), out.data_ptr<uint8_t>(),
                    device::stream());
  device::check_launch();
  return out;
}

std::tuple<at::Tensor, at::Tensor> cast_rows_cuda(const at::Tensor& rows, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "cnr::cast_rows: dtype must be float32, float16 or bfloat16, got ", dtype);
  const device::Guard guard(rows.device());
  const auto x = checked_rows(rows, "cast_rows");
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
  check_bits(bits, "quantize_uniform");
  const bool scale_half = is_half(scale_dtype, "scale_dtype", "quantize_uniform");
  const bool bias_half = is_half(bias_dtype, "bias_dtype", "quantize_uniform");
  const device::Guard guard(rows.device());
  const auto x = checked_rows(rows, "quantize_uniform");
  const int64_t n = x.size(0), dim = x.size(1);
  TORCH_CHECK_VALUE(grid_bias.has_value() == grid_scale.has_value(),
                    "cnr::quantize_uniform: pass both grid_bias and grid_scale, or neither");
  at::Tensor gb, gs;
  if (grid_bias) {
    TORCH_CHECK_VALUE(!symmetric, "cnr::quantize_uniform: a grid applies to asymmetric quantization only");
    gb = grid_bias->to(x.device(), at::kFloat).contiguous();
    gs = grid_scale->to(x.device(), at::kFloat).contiguous();
    TORCH_CHECK_VALUE(gb.dim() == 1 && gb.size(0) == n && gs.dim() == 1 && gs.size(0) == n,
                      "cnr::quantize_uniform: grid_bias and grid_scale need one entry per row (", n, ")");
  }
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
  check_bits(bits, "dequantize_uniform");
  const device::Guard guard(payload.device());
  const auto p = checked_payload(payload, bits, dim, "dequantize_uniform");
  const int64_t n = p.size(0);
  const auto s = checked_params(scale, n, p, "scale", "dequantize_uniform");
  const auto b = bias ? checked_params(*bias, n, p, "bias", "dequantize_uniform") : at::Tensor();
  auto out = at::empty({n, dim}, p.options().dtype(at::kFloat));
  cuda::dequantize_uniform(p.data_ptr<uint8_t>(), n, dim, static_cast<int>(bits), s.data_ptr(),
                           s.scalar_type() == at::kHalf, bias ? b.data_ptr() : nullptr,
                           bias && b.scalar_type() == at::kHalf, out.data_ptr<float>(),
                           device::stream());
  device::check_launch();
  return out;
}

// The CUDA path decodes into a temporary and scatters it with index_copy_, which
// is memory-bound on the GPU anyway.
void dequantize_uniform_into_cuda(const at::Tensor& payload, const at::Tensor& scale,
                                  const std::optional<at::Tensor>& bias, int64_t bits, const at::Tensor& rows,
                                  const at::Tensor& out) {
  TORCH_CHECK_VALUE(out.dim() == 2 && out.scalar_type() == at::kFloat,
                    "cnr::dequantize_uniform_into_: out must be a 2-D float32 tensor, got ", out.scalar_type(), " ",
                    out.sizes());
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.numel() == payload.size(0),
                    "cnr::dequantize_uniform_into_: rows must hold one entry per payload row");
  const auto r = rows.to(out.device(), at::kLong);
  TORCH_CHECK_INDEX(r.numel() == 0 || device::to_host(r.max()).item<int64_t>() < out.size(0),
                    "cnr::dequantize_uniform_into_: rows reach beyond out's ", out.size(0), " rows");
  const auto keep = (r >= 0).nonzero().squeeze(1);
  const auto dev = out.device();  // a restore's payload is read into host memory
  const auto decoded = dequantize_uniform_cuda(
      payload.to(dev).index_select(0, keep), scale.to(dev).index_select(0, keep),
      bias ? std::optional<at::Tensor>(bias->to(dev).index_select(0, keep)) : std::nullopt, bits, out.size(1));
  const_cast<at::Tensor&>(out).index_copy_(0, r.index_select(0, keep), decoded);
}

std::tuple<at::Tensor, at::Tensor> adaptive_search_cuda(const at::Tensor& rows, int64_t bits, int64_t num_bins,
                                                        double ratio, int64_t refit_iters) {
  check_bits(bits, "adaptive_search");
  TORCH_CHECK_VALUE(num_bins >= 1, "cnr::adaptive_search: num_bins must be >= 1, got ", num_bins);
  TORCH_CHECK_VALUE(ratio > 0.0 && ratio <= 1.0, "cnr::adaptive_search: ratio must be in (0, 1], got ", ratio);
  TORCH_CHECK_VALUE(refit_iters >= 0, "cnr::adaptive_search: refit_iters must be >= 0, got ", refit_iters);
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
  const auto grid = adaptive_search_cuda(rows, bits, num_bins, ratio, refit_iters);
  return quantize_uniform_cuda(rows, bits, false, scale_dtype, bias_dtype, std::get<0>(grid), std::get<1>(grid));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kmeans_quantize_cuda(
    const at::Tensor& rows, int64_t bits, int64_t iters, at::ScalarType codebook_dtype,
    const std::optional<at::Tensor>& grid_bias, const std::optional<at::Tensor>& grid_scale) {
  check_bits(bits, "kmeans_quantize");
  const bool half = is_half(codebook_dtype, "codebook_dtype", "kmeans_quantize");
  TORCH_CHECK_VALUE(iters >= 0, "cnr::kmeans_quantize: iters must be >= 0, got ", iters);
  const device::Guard guard(rows.device());
  const auto x = checked_rows(rows, "kmeans_quantize");
  const int64_t n = x.size(0), dim = x.size(1), k = std::min<int64_t>(int64_t{1} << bits, dim);
  TORCH_CHECK_VALUE(grid_bias.has_value() == grid_scale.has_value(),
                    "cnr::kmeans_quantize: pass both grid_bias and grid_scale, or neither");
  at::Tensor gb, gs;
  if (grid_bias) {
    gb = grid_bias->to(x.device(), at::kFloat).contiguous();
    gs = grid_scale->to(x.device(), at::kFloat).contiguous();
    TORCH_CHECK_VALUE(gb.dim() == 1 && gb.size(0) == n && gs.dim() == 1 && gs.size(0) == n,
                      "cnr::kmeans_quantize: grid_bias and grid_scale need one entry per row (", n, ")");
  }
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
  check_bits(bits, "dequantize_codebook");
  const device::Guard guard(payload.device());
  const auto p = checked_payload(payload, bits, dim, "dequantize_codebook");
  const int64_t n = p.size(0);
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == n && bias.scalar_type() == at::kFloat,
                    "cnr::dequantize_codebook: bias must be float32 with one entry per row (", n, ")");
  TORCH_CHECK_VALUE(codebook.dim() == 2 && codebook.size(0) == n && codebook.size(1) < (1 << bits) &&
                        (codebook.scalar_type() == at::kFloat || codebook.scalar_type() == at::kHalf),
                    "cnr::dequantize_codebook: codebook must be float32/float16 [N, K - 1] with K <= 2**bits, got ",
                    codebook.scalar_type(), " ", codebook.sizes());
  const auto b = bias.to(p.device()).contiguous();
  const auto cb = codebook.to(p.device()).contiguous();
  auto out = at::empty({n, dim}, p.options().dtype(at::kFloat));
  auto bad = at::zeros({1}, p.options().dtype(at::kInt));
  cuda::dequantize_codebook(p.data_ptr<uint8_t>(), n, dim, static_cast<int>(bits), b.data_ptr<float>(), cb.data_ptr(),
                            cb.scalar_type() == at::kHalf, cb.size(1), out.data_ptr<float>(), bad.data_ptr<int>(),
                            device::stream());
  device::check_launch();
  // One small device-to-host copy per decode keeps corrupt payloads a hard error.
  TORCH_CHECK_VALUE(device::to_host(bad).item<int>() == 0, "cnr::dequantize_codebook: the payload holds codes beyond the ",
                    cb.size(1) + 1, "-entry codebook; the encoded rows are corrupt");
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
