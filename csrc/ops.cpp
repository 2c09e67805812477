// The `cnr` library: its schemas (schemas.h) and the Meta kernels of the ops
// whose output shape follows from their inputs. Backend kernels live in
// cpu/<family>.cpp and cuda/<family>.cu (bound in cuda/<family>_bind.cpp).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "codecs_meta.h"
#include "schemas.h"

namespace cnr {
namespace {

void mark_rows_meta(
    const at::Tensor& /*indices*/,
    const at::Tensor& /*offsets*/,
    const at::Tensor& /*hash_size_cumsum*/,
    const at::Tensor& /*rows_per_table*/,
    const at::Tensor& /*bitmap*/,
    const std::optional<at::Tensor>& /*counts*/,
    const std::optional<at::Tensor>& /*B_offsets*/,
    const std::optional<at::Tensor>& /*errors*/) {}

at::Tensor bitmap_count_meta(const at::Tensor& bitmap, const at::Tensor& boundaries) {
  // Symbolic sizes, so that the op traces under dynamic shapes.
  return at::empty_symint({boundaries.sym_numel() - 1}, bitmap.options().dtype(at::kLong));
}

void bitmap_clear_meta(const at::Tensor& /*bitmap*/, int64_t /*start*/, int64_t /*end*/) {}

void scatter_rows_meta(const at::Tensor& /*out*/, const at::Tensor& /*index*/, const at::Tensor& /*src*/) {}

at::Tensor row_crc32c_meta(at::TensorList parts, int64_t rows_per_check, const std::optional<at::Tensor>& groups) {
  TORCH_CHECK_VALUE(!parts.empty(), "cnr::row_crc32c: give at least one part");
  TORCH_CHECK_VALUE(rows_per_check >= 1, "cnr::row_crc32c: rows_per_check must be >= 1, got ", rows_per_check);
  const int64_t count = groups ? groups->numel() : (parts[0].size(0) + rows_per_check - 1) / rows_per_check;
  return at::empty({count}, parts[0].options().dtype(at::kInt));
}

at::Tensor claim_rows_meta(const at::Tensor& filled, const std::optional<at::Tensor>& /*offsets*/, int64_t count,
                           int64_t /*lo*/, int64_t /*hi*/, int64_t /*shift*/) {
  return at::empty({count}, filled.options().dtype(at::kLong));
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY(cnr, m) { cnr::define_ops(m); }

TORCH_LIBRARY_IMPL(cnr, Meta, m) {
  m.impl("mark_rows", &cnr::mark_rows_meta);
  m.impl("bitmap_count", &cnr::bitmap_count_meta);
  m.impl("bitmap_clear_", &cnr::bitmap_clear_meta);
  m.impl("scatter_rows_", &cnr::scatter_rows_meta);
  m.impl("claim_rows_", &cnr::claim_rows_meta);
  m.impl("row_crc32c", &cnr::row_crc32c_meta);
  // CODEC-META-BEGIN
  m.impl("pack_bits", &cnr::codecs_meta::pack_bits);
  m.impl("unpack_bits", &cnr::codecs_meta::unpack_bits);
  m.impl("cast_rows", &cnr::codecs_meta::cast_rows);
  m.impl("quantize_uniform", &cnr::codecs_meta::quantize_uniform);
  m.impl("dequantize_uniform", &cnr::codecs_meta::dequantize_uniform);
  m.impl("dequantize_uniform_into_", &cnr::codecs_meta::dequantize_uniform_into_);
  m.impl("adaptive_search", &cnr::codecs_meta::adaptive_search);
  m.impl("adaptive_quantize", &cnr::codecs_meta::adaptive_quantize);
  m.impl("exhaustive_search", &cnr::codecs_meta::exhaustive_search);
  m.impl("kmeans_quantize", &cnr::codecs_meta::kmeans_quantize);
  m.impl("dequantize_codebook", &cnr::codecs_meta::dequantize_codebook);
  // CODEC-META-END
}

// `import cnr_torchrec._C` loads this library and so registers the ops above;
// the Python module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
