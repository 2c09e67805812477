// Every operator schema of cnr_torchrec, in one function: ops.cpp defines them
// for the `cnr` library, and the emulated CUDA build (csrc/cuda_emu/) defines the
// same schemas for `cnr_emu`, so both backends are called with one signature.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

namespace cnr {

inline void define_ops(torch::Library& m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};

  // ---- dirty-row tracking (cpu/tracking.cpp, cuda/tracking.cu) -------------
  // Sets bit (hash_size_cumsum[f] + indices[i]) of `bitmap` (int64 words, 1 bit
  // per flat TBE row) for every index i of feature f, in the TBE's feature-major
  // layout. hash_size_cumsum (T+1) and rows_per_table (T) are the TBE's own
  // per-feature buffers: feature f's table starts at flat row hash_size_cumsum[f]
  // and holds rows_per_table[f] rows, so features that share a table mark the
  // same rows. An id of -1 is a pruned row and is skipped, as FBGEMM does.
  // B_offsets (T+1) gives each feature's first bag for variable batch sizes;
  // without it every feature has (offsets.numel() - 1) / T bags. `counts`
  // (int32, one per row) is incremented per lookup and saturates. Every tensor
  // is on the bitmap's device. Raises IndexError for any other id outside its
  // table (the other ids are marked) and ValueError for offsets that are
  // negative, decrease, or run past the indices (nothing is marked: checked
  // before any id is read, so a tracked lookup needs no other bounds check).
  // With `errors` (int64 [kLookupRecordSize], zeros; tracking_checks.h) the
  // problems are recorded there instead, on the device, with no host sync, and
  // raise_lookup_errors raises them later with the same messages.
  m.def(
      "mark_rows(Tensor indices, Tensor offsets, Tensor hash_size_cumsum, Tensor rows_per_table, Tensor(a!) bitmap, "
      "Tensor(b!)? counts=None, Tensor? B_offsets=None, Tensor(c!)? errors=None) -> ()",
      tags);
  // Raises the first problem recorded in mark_rows' `errors`, if any (reads it on the host).
  m.def("raise_lookup_errors(Tensor errors) -> ()", tags);
  // Sorted int64 ids of the set bits in rows [start, end).
  m.def("bitmap_to_rows(Tensor bitmap, int start, int end) -> Tensor", tags);
  // Number of set bits in each range [boundaries[r], boundaries[r + 1]).
  m.def("bitmap_count(Tensor bitmap, Tensor boundaries) -> Tensor", tags);
  // Clears the bits of rows [start, end).
  m.def("bitmap_clear_(Tensor(a!) bitmap, int start, int end) -> ()", tags);

  // ---- restore (cpu/rows.cpp, cuda/rows_bind.cpp) ---------------------------
  // out[index[i]] = src[i], whole rows: out and src 2-D with equal columns and
  // dtype; out's columns contiguous (row stride free, so a column slice of a
  // TBE weight works). A negative index skips its row. An index past out's rows
  // raises before anything is written; a repeated index leaves one of its rows
  // (which one is unspecified).
  m.def("scatter_rows_(Tensor(a!) out, Tensor index, Tensor src) -> ()", tags);
  // The `count` stored rows of a checkpoint entry sit at entry rows offsets[p]
  // (p itself when offsets is None). Returns int64 [count]: for each stored row
  // whose entry row o is in [lo, hi) and whose shard row o + shift is not yet
  // `filled`, that shard row, which it then marks filled; -1 for every other.
  // The result is the `rows` of dequantize_uniform_into_ and the `index` of
  // scatter_rows_. A shard row outside `filled` raises before anything changes.
  m.def("claim_rows_(Tensor(a!) filled, Tensor? offsets, int count, int lo, int hi, int shift) -> Tensor", tags);
  // int32 [ceil(N / rows_per_check)]: the CRC-32C of each group of rows_per_check
  // rows (the last group may be shorter), over the group's rows of `parts`, part
  // after part: a group's CRC covers parts[0][i..j), then parts[1][i..j), and so
  // on (for one row a group, that row's bytes across the parts). Every part is 2-D uint8
  // [N, bytes] on the CPU (cpu/checks.cpp; a save writes them with the rows, a
  // restore checks the groups it reads against them). With `groups` (int64),
  // only those groups' CRCs, in that order: a reader hashes the groups it
  // needs in place, with no copy.
  m.def("row_crc32c(Tensor[] parts, int rows_per_check=1, Tensor? groups=None) -> Tensor", tags);

  // ---- row codecs (cpu/codecs*.cpp, cuda/codecs.cu) -------------------------
  // CODEC-SCHEMAS-BEGIN
  // Rows are float32 [N, D]. Codes of `bits` in {2, 3, 4, 8} are packed per row
  // as an LSB-first bit stream padded to a byte: ceil(D * bits / 8) bytes (eight
  // codes make `bits` bytes; FBGEMM's layout for 2, 4 and 8 bits). Encoders
  // return a uint8 `status` per row: 1 = the row holds a NaN or an Inf, 2 = a
  // parameter or value does not fit its storage dtype; such rows are zeroed.
  m.def("pack_bits(Tensor codes, int bits) -> Tensor", tags);
  m.def("unpack_bits(Tensor packed, int bits, int dim) -> Tensor", tags);
  // none / fp16 / bf16: the rows' bytes in `dtype`, and the status.
  m.def("cast_rows(Tensor rows, ScalarType dtype) -> (Tensor payload, Tensor status)", tags);
  // Uniform quantization, x ~ bias + scale * q. Symmetric: x ~ scale * (q - qmax),
  // qmax = 2**(bits-1) - 1, and `bias` is empty. Asymmetric grids default to
  // [min, max]; grid_bias / grid_scale (float32 [N], from a search) replace them.
  m.def(
      "quantize_uniform(Tensor rows, int bits, bool symmetric, ScalarType scale_dtype, ScalarType bias_dtype, "
      "Tensor? grid_bias=None, Tensor? grid_scale=None) -> (Tensor payload, Tensor scale, Tensor bias, "
      "Tensor status)",
      tags);
  // A missing bias means symmetric codes.
  m.def("dequantize_uniform(Tensor payload, Tensor scale, Tensor? bias, int bits, int dim) -> Tensor", tags);
  // Row r of dequantize_uniform's output, written to out[rows[r]] instead
  // (rows[r] < 0: skipped); out is float32 [M, dim] with contiguous columns.
  // accumulate: added onto out[rows[r]] (a residual chain's restore), which then
  // needs distinct destinations; the sum is out + decoded, rounded once.
  m.def(
      "dequantize_uniform_into_(Tensor payload, Tensor scale, Tensor? bias, int bits, Tensor rows, Tensor(a!) out, "
      "bool accumulate=False) -> ()",
      tags);
  // Greedy clipping-range search of Check-N-Run plus least-squares refits: the
  // asymmetric grid (bias, scale) of each row, float32 [N]; NaN for bad rows.
  m.def(
      "adaptive_search(Tensor rows, int bits, int num_bins, float ratio, int refit_iters) -> (Tensor bias, "
      "Tensor scale)",
      tags);
  // adaptive_search then quantize_uniform on its grid, fused: the same bytes.
  m.def(
      "adaptive_quantize(Tensor rows, int bits, int num_bins, float ratio, int refit_iters, ScalarType scale_dtype, "
      "ScalarType bias_dtype) -> (Tensor payload, Tensor scale, Tensor bias, Tensor status)",
      tags);
  // Best range on a grid of `grid` steps over [min, max] (for measurements).
  m.def("exhaustive_search(Tensor rows, int bits, int grid) -> (Tensor bias, Tensor scale)", tags);
  // Per-row k-means with K = min(2**bits, D) centroids: bias (float32 [N], the
  // smallest centroid) and codebook ([N, K - 1] offsets from it). Lloyd starts
  // from the asymmetric grid grid_bias + grid_scale * k if given, else [min, max].
  m.def(
      "kmeans_quantize(Tensor rows, int bits, int iters, ScalarType codebook_dtype, Tensor? grid_bias=None, "
      "Tensor? grid_scale=None) -> (Tensor payload, Tensor bias, Tensor codebook, Tensor status)",
      tags);
  m.def("dequantize_codebook(Tensor payload, Tensor bias, Tensor codebook, int bits, int dim) -> Tensor", tags);
  // CODEC-SCHEMAS-END
}

}  // namespace cnr
