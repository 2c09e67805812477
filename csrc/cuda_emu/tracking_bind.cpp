// csrc/cuda/tracking_bind.cpp for the emulated build: device.h registers its ops
// for the CPU key of `cnr_emu` when CNR_CUDA_EMU is defined.
#include "../cuda/tracking_bind.cpp"
