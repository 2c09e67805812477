// Launchers of the CUDA row-codec kernels. Plain pointers and a cudaStream_t
// only: this header and codecs.cu include no torch header, so nvcc compiles them
// on a machine whose torch is a CPU build. codecs_bind.cpp adapts them to torch.
//
// Layouts are those of the CPU kernels (see the schemas in ops.cpp): rows are
// float32 [n, dim]; packed rows hold ceil(dim * bits / 8) bytes, an LSB-first
// bit stream; status is one byte per row (1 = NaN / Inf, 2 = overflow). Per-row
// parameters are float32, or float16 where `*_half` is set. Quantization and
// dequantization round exactly like the CPU kernels (no FMA contraction), so
// their bytes match; the searches and k-means sum in another order, so a near
// tie may resolve differently.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cnr::cuda {

void pack_bits(const uint8_t* codes, int64_t n, int64_t dim, int bits, uint8_t* packed, cudaStream_t stream);
void unpack_bits(const uint8_t* packed, int64_t n, int64_t dim, int bits, uint8_t* codes, cudaStream_t stream);

// dtype: 0 float32, 1 float16, 2 bfloat16.
void cast_rows(const float* rows, int64_t n, int64_t dim, int dtype, uint8_t* payload, uint8_t* status,
               cudaStream_t stream);

// grid_bias / grid_scale may be null (asymmetric grids then span [min, max]).
void quantize_uniform(const float* rows, int64_t n, int64_t dim, int bits, bool symmetric, bool scale_half,
                      bool bias_half, const float* grid_bias, const float* grid_scale, uint8_t* payload, void* scale,
                      void* bias, uint8_t* status, cudaStream_t stream);

// bias null: symmetric codes.
void dequantize_uniform(const uint8_t* payload, int64_t n, int64_t dim, int bits, const void* scale, bool scale_half,
                        const void* bias, bool bias_half, float* out, cudaStream_t stream);

// `rounds` greedy moves, then `refit_iters` least-squares refits (see codecs_search.cpp).
void adaptive_search(const float* rows, int64_t n, int64_t dim, int bits, int64_t num_bins, int64_t rounds,
                     int64_t refit_iters, float* lo, float* scale, cudaStream_t stream);

// K = min(2**bits, dim) centroids; codebook holds K - 1 offsets per row. Lloyd
// starts from grid_bias + grid_scale * k when they are given, else [min, max].
void kmeans_quantize(const float* rows, int64_t n, int64_t dim, int bits, int64_t iters, bool codebook_half,
                     const float* grid_bias, const float* grid_scale, uint8_t* payload, float* bias, void* codebook,
                     uint8_t* status, cudaStream_t stream);

// k1 = codebook entries per row (K - 1). *bad_code (device int) is set when a code exceeds k1.
void dequantize_codebook(const uint8_t* payload, int64_t n, int64_t dim, int bits, const float* bias,
                         const void* codebook, bool codebook_half, int64_t k1, float* out, int* bad_code,
                         cudaStream_t stream);

}  // namespace cnr::cuda
