// Every operator schema of the `cnr` namespace, plus the Meta kernels of the ops
// whose output shape follows from their inputs. Backend kernels live in
// cpu/<family>.cpp and cuda/<family>.cu (bound in cuda/<family>_bind.cpp).
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

namespace cnr {
namespace {

void mark_rows_meta(
    const at::Tensor& /*indices*/,
    const at::Tensor& /*offsets*/,
    const at::Tensor& /*hash_size_cumsum*/,
    const at::Tensor& /*bitmap*/,
    const std::optional<at::Tensor>& /*counts*/,
    const std::optional<at::Tensor>& /*B_offsets*/) {}

at::Tensor bitmap_count_meta(const at::Tensor& bitmap, const at::Tensor& boundaries) {
  // Symbolic sizes, so that the op traces under dynamic shapes.
  return at::empty_symint({boundaries.sym_numel() - 1}, bitmap.options().dtype(at::kLong));
}

void bitmap_clear_meta(const at::Tensor& /*bitmap*/, int64_t /*start*/, int64_t /*end*/) {}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY(cnr, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};

  // ---- dirty-row tracking (cpu/tracking.cpp, cuda/tracking.cu) -------------
  // Sets bit (hash_size_cumsum[f] + indices[i]) of `bitmap` (int64 words, 1 bit
  // per flat TBE row) for every index i of feature f, in the TBE's feature-major
  // layout. B_offsets (T+1) gives each feature's first bag for variable batch
  // sizes; without it every feature has (offsets.numel() - 1) / T bags.
  // `counts` (int32, one per row) is incremented per lookup and saturates.
  m.def(
      "mark_rows(Tensor indices, Tensor offsets, Tensor hash_size_cumsum, Tensor(a!) bitmap, "
      "Tensor(b!)? counts=None, Tensor? B_offsets=None) -> ()",
      tags);
  // Sorted int64 ids of the set bits in rows [start, end).
  m.def("bitmap_to_rows(Tensor bitmap, int start, int end) -> Tensor", tags);
  // Number of set bits in each range [boundaries[r], boundaries[r + 1]).
  m.def("bitmap_count(Tensor bitmap, Tensor boundaries) -> Tensor", tags);
  // Clears the bits of rows [start, end).
  m.def("bitmap_clear_(Tensor(a!) bitmap, int start, int end) -> ()", tags);

  // ---- row codecs (cpu/codecs.cpp, cuda/codecs.cu) --------------------------
  // CODEC-SCHEMAS-BEGIN
  // CODEC-SCHEMAS-END
}

TORCH_LIBRARY_IMPL(cnr, Meta, m) {
  m.impl("mark_rows", &cnr::mark_rows_meta);
  m.impl("bitmap_count", &cnr::bitmap_count_meta);
  m.impl("bitmap_clear_", &cnr::bitmap_clear_meta);
  // CODEC-META-BEGIN
  // CODEC-META-END
}

// `import cnr_torchrec._C` loads this library and so registers the ops above;
// the Python module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
