// Meta kernels of the row-codec ops (schemas in ops.cpp): every output shape
// follows from the input shapes and the integer arguments. Sizes stay symbolic
// so that torch.compile with dynamic shapes can trace the ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <tuple>

namespace cnr::codecs_meta {

inline c10::SymInt packed_bytes(const c10::SymInt& dim, int64_t bits) { return (dim * bits + 7) / 8; }

inline at::Tensor pack_bits(const at::Tensor& codes, int64_t bits) {
  return at::empty_symint({codes.sym_size(0), packed_bytes(codes.sym_size(1), bits)}, codes.options());
}

inline at::Tensor unpack_bits(const at::Tensor& packed, int64_t /*bits*/, int64_t dim) {
  return at::empty_symint({packed.sym_size(0), c10::SymInt(dim)}, packed.options());
}

inline std::tuple<at::Tensor, at::Tensor> cast_rows(const at::Tensor& rows, at::ScalarType dtype) {
  const auto n = rows.sym_size(0);
  return {at::empty_symint({n, rows.sym_size(1) * static_cast<int64_t>(c10::elementSize(dtype))},
                           rows.options().dtype(at::kByte)),
          at::empty_symint({n}, rows.options().dtype(at::kByte))};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_uniform(
    const at::Tensor& rows, int64_t bits, bool symmetric, at::ScalarType scale_dtype, at::ScalarType bias_dtype,
    const std::optional<at::Tensor>& /*grid_bias*/, const std::optional<at::Tensor>& /*grid_scale*/) {
  const auto n = rows.sym_size(0);
  return {at::empty_symint({n, packed_bytes(rows.sym_size(1), bits)}, rows.options().dtype(at::kByte)),
          at::empty_symint({n}, rows.options().dtype(scale_dtype)),
          at::empty_symint({symmetric ? c10::SymInt(0) : n}, rows.options().dtype(bias_dtype)),
          at::empty_symint({n}, rows.options().dtype(at::kByte))};
}

inline at::Tensor dequantize_uniform(const at::Tensor& payload, const at::Tensor& /*scale*/,
                                     const std::optional<at::Tensor>& /*bias*/, int64_t /*bits*/, int64_t dim) {
  return at::empty_symint({payload.sym_size(0), c10::SymInt(dim)}, payload.options().dtype(at::kFloat));
}

inline void dequantize_uniform_into_(const at::Tensor& /*payload*/, const at::Tensor& /*scale*/,
                                     const std::optional<at::Tensor>& /*bias*/, int64_t /*bits*/,
                                     const at::Tensor& /*rows*/, const at::Tensor& /*out*/, bool /*accumulate*/) {}

inline std::tuple<at::Tensor, at::Tensor> search(const at::Tensor& rows) {
  return {at::empty_symint({rows.sym_size(0)}, rows.options()), at::empty_symint({rows.sym_size(0)}, rows.options())};
}

inline std::tuple<at::Tensor, at::Tensor> adaptive_search(const at::Tensor& rows, int64_t /*bits*/,
                                                          int64_t /*num_bins*/, double /*ratio*/,
                                                          int64_t /*refit_iters*/) {
  return search(rows);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> adaptive_quantize(
    const at::Tensor& rows, int64_t bits, int64_t /*num_bins*/, double /*ratio*/, int64_t /*refit_iters*/,
    at::ScalarType scale_dtype, at::ScalarType bias_dtype) {
  return quantize_uniform(rows, bits, false, scale_dtype, bias_dtype, std::nullopt, std::nullopt);
}

inline std::tuple<at::Tensor, at::Tensor> exhaustive_search(const at::Tensor& rows, int64_t /*bits*/,
                                                            int64_t /*grid*/) {
  return search(rows);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kmeans_quantize(
    const at::Tensor& rows, int64_t bits, int64_t /*iters*/, at::ScalarType codebook_dtype,
    const std::optional<at::Tensor>& /*grid_bias*/, const std::optional<at::Tensor>& /*grid_scale*/) {
  const auto n = rows.sym_size(0);
  const auto dim = rows.sym_size(1);
  // K = min(2**bits, D) centroids: the bias holds the first, the codebook the rest.
  const auto k = dim.min(c10::SymInt(int64_t{1} << bits));
  return {at::empty_symint({n, packed_bytes(dim, bits)}, rows.options().dtype(at::kByte)),
          at::empty_symint({n}, rows.options()), at::empty_symint({n, k - 1}, rows.options().dtype(codebook_dtype)),
          at::empty_symint({n}, rows.options().dtype(at::kByte))};
}

inline at::Tensor dequantize_codebook(const at::Tensor& payload, const at::Tensor& /*bias*/,
                                      const at::Tensor& /*codebook*/, int64_t /*bits*/, int64_t dim) {
  return at::empty_symint({payload.sym_size(0), c10::SymInt(dim)}, payload.options().dtype(at::kFloat));
}

}  // namespace cnr::codecs_meta
