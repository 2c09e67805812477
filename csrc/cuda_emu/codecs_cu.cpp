// csrc/cuda/codecs.cu compiled as host C++ under the CUDA emulation: the same
// source as the CUDA build, its kernels run by runtime.cpp.
#include "../cuda/codecs.cu"
