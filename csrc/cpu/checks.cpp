// CPU kernel of row_crc32c: the CRC-32C of each group of stored rows, so that a
// restore which reads some rows of an entry checks the groups it reads, and no
// more (ckpt/format/bytes/rows.py).
//
// CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and final
// xor all ones) is the checksum S3, GCS and iSCSI use. x86-64-v2, which the build
// targets, has it as an instruction (SSE4.2 crc32): 8 bytes a cycle when three
// groups are hashed side by side, so a 20-byte row costs a few nanoseconds. Other CPUs (and CNR_PORTABLE builds) use
// a table built from the polynomial at start-up. Tests compare both with the
// google-crc32c package.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#if defined(__SSE4_2__) && !defined(CNR_NO_X86_INTRINSICS)
#include <nmmintrin.h>
#define CNR_CRC32C_HW 1
#endif

namespace cnr {
namespace {

#ifdef CNR_CRC32C_HW
// Continues `crc` (the register, not yet inverted) over `n` bytes.
inline uint32_t crc32c_update(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  if (n >= 4) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    c32 = _mm_crc32_u32(c32, w);
    p += 4;
    n -= 4;
  }
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

// Three CRCs over three runs of `n` bytes at once. One crc32 waits three cycles for
// the one before it on the same register, so three independent registers keep the
// unit busy: about three times one run's rate.
inline void crc32c_update3(uint32_t* crc, const unsigned char* const* p, size_t n) {
  uint64_t a = crc[0], b = crc[1], c = crc[2];
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t wa, wb, wc;
    std::memcpy(&wa, p[0] + i, 8);
    std::memcpy(&wb, p[1] + i, 8);
    std::memcpy(&wc, p[2] + i, 8);
    a = _mm_crc32_u64(a, wa);
    b = _mm_crc32_u64(b, wb);
    c = _mm_crc32_u64(c, wc);
  }
  crc[0] = crc32c_update(static_cast<uint32_t>(a), p[0] + i, n - i);
  crc[1] = crc32c_update(static_cast<uint32_t>(b), p[1] + i, n - i);
  crc[2] = crc32c_update(static_cast<uint32_t>(c), p[2] + i, n - i);
}
#else
std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    t[b] = c;
  }
  return t;
}

inline uint32_t crc32c_update(uint32_t crc, const unsigned char* p, size_t n) {
  static const std::array<uint32_t, 256> table = make_table();
  for (; n > 0; --n, ++p) crc = table[(crc ^ *p) & 0xFFu] ^ (crc >> 8);
  return crc;
}
#endif

struct Part {
  const unsigned char* data;
  int64_t stride;  // bytes from one row to the next
  size_t width;    // bytes of a row
};

at::Tensor row_crc32c_cpu(at::TensorList parts, int64_t rows_per_check, const std::optional<at::Tensor>& groups) {
  TORCH_CHECK_VALUE(!parts.empty(), "cnr::row_crc32c: give at least one part");
  TORCH_CHECK_VALUE(rows_per_check >= 1, "cnr::row_crc32c: rows_per_check must be >= 1, got ", rows_per_check);
  const int64_t n = parts[0].dim() > 0 ? parts[0].size(0) : 0;
  std::vector<at::Tensor> keep;  // the parts with contiguous rows, alive while they are read
  std::vector<Part> views;
  for (size_t k = 0; k < parts.size(); ++k) {
    const at::Tensor& p = parts[k];
    TORCH_CHECK_VALUE(p.dim() == 2 && p.scalar_type() == at::kByte && p.device().is_cpu(),
                      "cnr::row_crc32c: every part must be a 2-D uint8 CPU tensor (a blob viewed as [rows, bytes]), "
                      "part ", k, " is ", p.scalar_type(), " ", p.sizes(), " on ", p.device());
    TORCH_CHECK_VALUE(p.size(0) == n, "cnr::row_crc32c: parts must have equal rows, part 0 has ", n, " and part ",
                      k, " has ", p.size(0));
    keep.push_back(p.stride(1) == 1 ? p : p.contiguous());
    const at::Tensor& c = keep.back();
    views.push_back({static_cast<const unsigned char*>(c.data_ptr()), c.stride(0), static_cast<size_t>(c.size(1))});
  }
  const int64_t all = (n + rows_per_check - 1) / rows_per_check;
  at::Tensor which;
  if (groups) {
    TORCH_CHECK_VALUE(groups->dim() == 1 && groups->scalar_type() == at::kLong && groups->device().is_cpu(),
                      "cnr::row_crc32c: groups must be a 1-D int64 CPU tensor, got ", groups->scalar_type(), " ",
                      groups->sizes());
    which = groups->contiguous();
    const int64_t* gp = which.data_ptr<int64_t>();
    for (int64_t j = 0; j < which.numel(); ++j) {
      TORCH_CHECK_INDEX(gp[j] >= 0 && gp[j] < all, "cnr::row_crc32c: group ", gp[j], " is outside the ", all,
                        " groups of ", rows_per_check, " of the parts' ", n, " rows");
    }
  }
  const int64_t count = groups ? which.numel() : all;
  const int64_t* gp = groups ? which.data_ptr<int64_t>() : nullptr;
  auto out = at::empty({count}, parts[0].options().dtype(at::kInt));
  auto* op = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  bool runs = true;  // every part's rows are one run of bytes, so a group is one run per part
  for (const Part& v : views) runs = runs && v.stride == static_cast<int64_t>(v.width);
  auto one_group = [&](int64_t g) {
    uint32_t crc = 0xFFFFFFFFu;
    const int64_t first = g * rows_per_check, end = std::min(n, first + rows_per_check);
    for (const Part& v : views) {
      if (v.stride == static_cast<int64_t>(v.width)) {
        crc = crc32c_update(crc, v.data + first * v.stride, static_cast<size_t>(end - first) * v.width);
      } else {
        for (int64_t i = first; i < end; ++i) crc = crc32c_update(crc, v.data + i * v.stride, v.width);
      }
    }
    return ~crc;
  };
  at::parallel_for(0, count, std::max<int64_t>(1, 16384 / rows_per_check), [&](int64_t j0, int64_t j1) {
    int64_t j = j0;
#ifdef CNR_CRC32C_HW
    // Whole groups three at a time (all of a group's bytes in a part are as long as any other whole group's).
    for (; runs && j + 3 <= j1; j += 3) {
      int64_t g[3];
      bool whole = true;
      for (int k = 0; k < 3; ++k) {
        g[k] = gp ? gp[j + k] : j + k;
        whole = whole && (g[k] + 1) * rows_per_check <= n;
      }
      if (!whole) {
        for (int k = 0; k < 3; ++k) op[j + k] = one_group(g[k]);
        continue;
      }
      uint32_t crc[3] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
      for (const Part& v : views) {
        const unsigned char* at[3];
        for (int k = 0; k < 3; ++k) at[k] = v.data + g[k] * rows_per_check * v.stride;
        crc32c_update3(crc, at, static_cast<size_t>(rows_per_check) * v.width);
      }
      for (int k = 0; k < 3; ++k) op[j + k] = ~crc[k];
    }
#endif
    for (; j < j1; ++j) op[j] = one_group(gp ? gp[j] : j);
  });
  return out;
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(cnr, CPU, m) { m.impl("row_crc32c", &cnr::row_crc32c_cpu); }
