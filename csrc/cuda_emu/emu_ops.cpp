// The `cnr_emu` library of the emulated CUDA build: the schemas of `cnr`
// (schemas.h), whose kernels are the CUDA bindings of csrc/cuda/*_bind.cpp
// registered for the CPU key (see device.h), plus what tests need to watch the
// emulated device: host_reads(), the number of device-to-host reads so far, and
// selftest(), kernels that test the emulation itself.
#include <Python.h>

#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "../schemas.h"

namespace cnr::device {
namespace {
std::atomic<int64_t> g_host_reads{0};
}  // namespace

// Declared in csrc/cuda/device.h; every to_host() of the bindings calls it.
void count_host_read() { g_host_reads.fetch_add(1, std::memory_order_relaxed); }

}  // namespace cnr::device

namespace cnr_emu {
at::Tensor run_selftest(const std::string& name);  // selftest.cpp
}  // namespace cnr_emu

namespace {
int64_t host_reads() { return cnr::device::g_host_reads.load(std::memory_order_relaxed); }
}  // namespace

TORCH_LIBRARY(cnr_emu, m) {
  cnr::define_ops(m);
  // Device-to-host reads made by the bound ops since the library loaded: a test
  // holds an op to the reads its CUDA twin would make (the hot path to none).
  m.def("host_reads() -> int", &host_reads);
  // Runs one of the kernels of selftest.cpp that test the emulation itself.
  m.def("selftest(str name) -> Tensor", &cnr_emu::run_selftest);
}

// `import cnr_torchrec._C_cuda_emu` loads this library and so registers the
// ops; the Python module itself is empty. PyMODINIT_FUNC exports it despite
// -fvisibility=hidden.
PyMODINIT_FUNC PyInit__C_cuda_emu(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_cuda_emu", nullptr, -1, nullptr,
                                          nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
