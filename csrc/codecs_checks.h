// Argument checks of the row-codec and restore ops, shared by the CPU kernels
// (cpu/codecs*.cpp, cpu/rows.cpp) and the CUDA bindings (cuda/codecs_bind.cpp,
// cuda/rows_bind.cpp), so that both backends accept and reject the same calls
// with the same messages. Each checker reads shapes, dtypes and devices; the few
// that need values (an index range, the largest code) take them from the host,
// and the CUDA bindings read them there first (see cuda/device.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>
#include <vector>

namespace cnr::codecs {

inline bool valid_bits(int64_t bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }

inline void check_bits(int64_t bits, const char* op) {
  TORCH_CHECK_VALUE(valid_bits(bits), "cnr::", op, ": bits must be 2, 3, 4 or 8, got ", bits);
}

// Bytes of one packed row: the codes form an LSB-first bit stream padded to a byte.
inline int64_t packed_bytes(int64_t dim, int64_t bits) { return (dim * bits + 7) / 8; }

inline at::Tensor checked_rows(const at::Tensor& rows, const char* op) {
  TORCH_CHECK_VALUE(rows.dim() == 2, "cnr::", op, ": rows must be 2-D [N, D], got ", rows.dim(), "-D");
  TORCH_CHECK_VALUE(rows.scalar_type() == at::kFloat, "cnr::", op, ": rows must be float32, got ",
                    rows.scalar_type());
  TORCH_CHECK_VALUE(rows.size(1) > 0, "cnr::", op, ": rows must have at least one column");
  return rows.contiguous();
}

// A parameter storage dtype; returns whether it is float16.
inline bool check_param_dtype(at::ScalarType dtype, const char* what, const char* op) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf, "cnr::", op, ": ", what,
                    " must be float32 or float16, got ", dtype);
  return dtype == at::kHalf;
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* what, const char* op) {
  TORCH_CHECK_VALUE(t.device() == like.device(), "cnr::", op, ": ", what, " is on ", t.device(), " but the input on ",
                    like.device(), "; keep them on one device");
}

// ---- pack_bits / unpack_bits ---------------------------------------------------

inline at::Tensor checked_codes(const at::Tensor& codes, int64_t bits) {
  check_bits(bits, "pack_bits");
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.scalar_type() == at::kByte,
                    "cnr::pack_bits: codes must be a 2-D uint8 tensor");
  return codes.contiguous();
}

inline void check_largest_code(int64_t largest, int64_t bits) {
  TORCH_CHECK_VALUE(largest < (int64_t{1} << bits), "cnr::pack_bits: codes must be below 2**bits = ", 1 << bits,
                    ", got ", largest);
}

// A payload of packed codes: [N, packed_bytes(dim, bits)] uint8.
inline at::Tensor checked_payload(const at::Tensor& payload, int64_t bits, int64_t dim, const char* op,
                                  const char* what = "payload") {
  check_bits(bits, op);
  TORCH_CHECK_VALUE(payload.dim() == 2 && payload.scalar_type() == at::kByte, "cnr::", op, ": ", what,
                    " must be a 2-D uint8 tensor");
  const int64_t nb = packed_bytes(dim, bits);
  TORCH_CHECK_VALUE(dim >= 0 && payload.size(1) == nb, "cnr::", op, ": ", dim, " codes of ", bits,
                    " bits need rows of ", nb, " bytes, got ", payload.size(1));
  return payload.contiguous();
}

// ---- encoders --------------------------------------------------------------------

inline void check_cast_dtype(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                    "cnr::cast_rows: dtype must be float32, float16 or bfloat16, got ", dtype);
}

// A search's grid (grid_bias, grid_scale): both or neither, float32 [N] on the rows' device.
inline std::pair<at::Tensor, at::Tensor> checked_grid(const std::optional<at::Tensor>& grid_bias,
                                                      const std::optional<at::Tensor>& grid_scale,
                                                      const at::Tensor& rows, bool symmetric, const char* op) {
  TORCH_CHECK_VALUE(grid_bias.has_value() == grid_scale.has_value(), "cnr::", op,
                    ": pass both grid_bias and grid_scale, or neither");
  if (!grid_bias) return {};
  TORCH_CHECK_VALUE(!symmetric, "cnr::", op, ": a grid applies to asymmetric quantization only");
  check_same_device(*grid_bias, rows, "grid_bias", op);
  check_same_device(*grid_scale, rows, "grid_scale", op);
  const int64_t n = rows.size(0);
  auto gb = grid_bias->to(at::kFloat).contiguous();
  auto gs = grid_scale->to(at::kFloat).contiguous();
  TORCH_CHECK_VALUE(gb.dim() == 1 && gb.size(0) == n && gs.dim() == 1 && gs.size(0) == n, "cnr::", op,
                    ": grid_bias and grid_scale need one entry per row (", n, ")");
  return {gb, gs};
}

inline void check_search(int64_t bits, int64_t num_bins, double ratio, int64_t refit_iters, const char* op) {
  check_bits(bits, op);
  TORCH_CHECK_VALUE(num_bins >= 1, "cnr::", op, ": num_bins must be >= 1, got ", num_bins);
  TORCH_CHECK_VALUE(ratio > 0.0 && ratio <= 1.0, "cnr::", op, ": ratio must be in (0, 1], got ", ratio);
  TORCH_CHECK_VALUE(refit_iters >= 0, "cnr::", op, ": refit_iters must be >= 0, got ", refit_iters);
}

inline void check_kmeans(int64_t bits, int64_t iters, at::ScalarType codebook_dtype) {
  check_bits(bits, "kmeans_quantize");
  check_param_dtype(codebook_dtype, "codebook_dtype", "kmeans_quantize");
  TORCH_CHECK_VALUE(iters >= 0, "cnr::kmeans_quantize: iters must be >= 0, got ", iters);
}

// ---- decoders ----------------------------------------------------------------------

// Per-row parameters of a payload: float32 or float16 [N], on the payload's device.
inline at::Tensor checked_params(const at::Tensor& t, int64_t n, const at::Tensor& payload, const char* what,
                                 const char* op) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
                    "cnr::", op, ": ", what, " must be a float32 or float16 vector with one entry per row (", n,
                    "), got ", t.scalar_type(), " ", t.sizes());
  check_same_device(t, payload, what, op);
  return t.contiguous();
}

inline void check_codebook(const at::Tensor& payload, const at::Tensor& bias, const at::Tensor& codebook,
                           int64_t bits) {
  const int64_t n = payload.size(0);
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == n && bias.scalar_type() == at::kFloat,
                    "cnr::dequantize_codebook: bias must be float32 with one entry per row (", n, ")");
  TORCH_CHECK_VALUE(codebook.dim() == 2 && codebook.size(0) == n && codebook.size(1) < (1 << bits) &&
                        (codebook.scalar_type() == at::kFloat || codebook.scalar_type() == at::kHalf),
                    "cnr::dequantize_codebook: codebook must be float32/float16 [N, K - 1] with K <= 2**bits, got ",
                    codebook.scalar_type(), " ", codebook.sizes());
  check_same_device(bias, payload, "bias", "dequantize_codebook");
  check_same_device(codebook, payload, "codebook", "dequantize_codebook");
}

inline void check_codes_in_codebook(bool bad_code, int64_t k1) {
  TORCH_CHECK_VALUE(!bad_code, "cnr::dequantize_codebook: the payload holds codes beyond the ", k1 + 1,
                    "-entry codebook; the encoded rows are corrupt");
}

// ---- writes into existing rows (dequantize_uniform_into_, scatter_rows_) -----------

inline void check_into_out(const at::Tensor& out) {
  TORCH_CHECK_VALUE(out.dim() == 2 && out.scalar_type() == at::kFloat && (out.size(1) <= 1 || out.stride(1) == 1),
                    "cnr::dequantize_uniform_into_: out must be a 2-D float32 tensor with contiguous columns, got ",
                    out.scalar_type(), " ", out.sizes(), " strides ", out.strides());
}

inline void check_into_rows(const at::Tensor& rows, int64_t n) {
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.numel() == n,
                    "cnr::dequantize_uniform_into_: rows must be 1-D int64 with one entry per payload row (", n,
                    "), got ", rows.scalar_type(), " ", rows.sizes());
}

inline void check_scatter(const at::Tensor& out, const at::Tensor& index, const at::Tensor& src) {
  TORCH_CHECK_VALUE(out.dim() == 2 && src.dim() == 2, "cnr::scatter_rows_: out and src must be 2-D, got ",
                    out.sizes(), " and ", src.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == src.scalar_type(), "cnr::scatter_rows_: out is ", out.scalar_type(),
                    " but src is ", src.scalar_type(), "; cast src first");
  TORCH_CHECK_VALUE(out.size(1) == src.size(1), "cnr::scatter_rows_: out rows have ", out.size(1),
                    " columns, src rows ", src.size(1));
  TORCH_CHECK_VALUE(index.dim() == 1 && index.scalar_type() == at::kLong && index.numel() == src.size(0),
                    "cnr::scatter_rows_: index must be 1-D int64 with one entry per src row, got ",
                    index.scalar_type(), " ", index.sizes(), " for ", src.size(0), " rows");
  TORCH_CHECK_VALUE(out.size(1) <= 1 || out.stride(1) == 1,
                    "cnr::scatter_rows_: out's columns must be contiguous (a row or column slice of a "
                    "contiguous tensor is fine), got strides ", out.strides());
}

// Every destination row below `limit` (negative ones are skipped), checked before
// anything is written. `index` is on the host.
inline void check_destinations(const int64_t* index, int64_t n, int64_t limit, const char* op, const char* what) {
  int64_t top = -1;  // a max vectorizes; the position is looked up on the error path only
  for (int64_t i = 0; i < n; ++i) top = std::max(top, index[i]);
  if (top < limit) return;
  int64_t i = 0;
  while (index[i] < limit) ++i;
  TORCH_CHECK_INDEX(false, "cnr::", op, ": ", what, " ", index[i], " at position ", i, " is outside out's ", limit,
                    " rows");
}

// Accumulating writes (dequantize_uniform_into_ with accumulate) add rows on
// several threads at once: two source rows into one destination would race.
inline void check_distinct_destinations(const int64_t* index, int64_t n, int64_t limit, const char* op) {
  std::vector<bool> seen(static_cast<size_t>(limit), false);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = index[i];
    if (d < 0) continue;
    TORCH_CHECK_VALUE(!seen[d], "cnr::", op, ": accumulate=True needs distinct destination rows, but row ", d,
                      " appears twice (the second time at position ", i, "); sum those rows first, or add them ",
                      "in two calls");
    seen[d] = true;
  }
}

}  // namespace cnr::codecs
