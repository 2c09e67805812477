// CPU kernels of the dirty-row tracking ops: one bit per flat TBE row, packed
// into int64 words. Threads that hit the same word meet in a relaxed atomic OR;
// a plain load first skips the atomic for rows that are already dirty, which is
// the common case under Zipf-skewed ids.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <climits>

#include "../tracking_checks.h"

namespace cnr {
namespace {

constexpr int64_t kGrain = 1 << 14;

inline uint64_t* words_of(const at::Tensor& bitmap) {
  return reinterpret_cast<uint64_t*>(bitmap.data_ptr<int64_t>());
}

void check_bitmap(const at::Tensor& bitmap, const char* op) {
  TORCH_CHECK(bitmap.dtype() == at::kLong && bitmap.dim() == 1 && bitmap.is_contiguous(), "cnr::", op,
              ": bitmap must be a contiguous 1-D int64 tensor of packed words, got ", bitmap.dtype(), " ",
              bitmap.sizes());
}

void check_range(const at::Tensor& bitmap, int64_t start, int64_t end, const char* op) {
  TORCH_CHECK(0 <= start && start <= end && end <= bitmap.numel() * 64, "cnr::", op, ": row range [", start, ", ",
              end, ") is outside the bitmap's ", bitmap.numel() * 64, " rows");
}

// Popcount of rows [start, end) in words.
int64_t count_bits(const uint64_t* words, int64_t start, int64_t end) {
  if (start >= end) return 0;
  const int64_t w0 = start >> 6, w1 = (end - 1) >> 6;
  const uint64_t head = ~0ull << (start & 63);
  const uint64_t tail = ~0ull >> (63 - ((end - 1) & 63));
  if (w0 == w1) return __builtin_popcountll(words[w0] & head & tail);
  int64_t n = __builtin_popcountll(words[w0] & head) + __builtin_popcountll(words[w1] & tail);
  for (int64_t w = w0 + 1; w < w1; ++w) n += __builtin_popcountll(words[w]);
  return n;
}

inline void bump_saturating(int32_t* counter) {
  int32_t cur = __atomic_load_n(counter, __ATOMIC_RELAXED);
  while (cur != INT32_MAX &&
         !__atomic_compare_exchange_n(counter, &cur, cur + 1, /*weak=*/true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// Marks positions [lo, hi) of the feature-major index array. Each feature's run is
// handled with its base row and its table's size in registers. An id of -1 is a
// pruned row, which FBGEMM's lookups skip: it is skipped here too, in the branch
// that catches bad ids, so the common path has no extra test. With kAtomic,
// concurrent chunks share words: a plain load skips the atomic OR for rows
// already marked.
template <bool kAtomic, typename index_t>
int64_t mark_span(const index_t* indices, const std::vector<int64_t>& begin, const int64_t* hsc,
                  const int64_t* rows_per_table, uint64_t* words, int32_t* counts, int64_t lo, int64_t hi) {
  int64_t bad = INT64_MAX;
  int64_t f = std::upper_bound(begin.begin(), begin.end(), lo) - begin.begin() - 1;
  for (int64_t i = lo; i < hi; ++f) {
    const int64_t stop = std::min(hi, begin[f + 1]);
    const int64_t base = hsc[f];
    const uint64_t size = static_cast<uint64_t>(rows_per_table[f]);
    for (; i < stop; ++i) {
      const int64_t id = static_cast<int64_t>(indices[i]);
      if (static_cast<uint64_t>(id) >= size) {  // also catches negative ids
        if (id != -1) bad = std::min(bad, i);
        continue;
      }
      const int64_t row = base + id;
      const uint64_t mask = 1ull << (row & 63);
      uint64_t* word = words + (row >> 6);
      if constexpr (kAtomic) {
        if (!(__atomic_load_n(word, __ATOMIC_RELAXED) & mask)) __atomic_fetch_or(word, mask, __ATOMIC_RELAXED);
        if (counts) bump_saturating(counts + row);
      } else {
        *word |= mask;
        if (counts && counts[row] != INT32_MAX) ++counts[row];
      }
    }
  }
  return bad;
}

// Bag b reads indices [offsets[b], offsets[b + 1]). A TBE lookup trusts that
// layout, and the ids checked here are those between the first and last offsets,
// so the layout is checked too: that makes this pass a full bounds check of the
// lookup, with the verdicts of FBGEMM's bounds_check_indices in FATAL mode.
template <typename offset_t>
void check_bag_layout(const offset_t* offsets, int64_t num_bags, int64_t num_indices) {
  TORCH_CHECK_VALUE(offsets[0] >= 0, "cnr::mark_rows: offsets start at ", offsets[0],
                    "; bag offsets must be non-negative");
  const offset_t* end = offsets + num_bags + 1;
  const offset_t* drop = std::is_sorted_until(offsets, end);
  TORCH_CHECK_VALUE(drop == end, "cnr::mark_rows: offsets decrease at bag ", drop - offsets - 1, " (",
                    drop[-1], " then ", drop[0], "); bag offsets must never decrease");
  TORCH_CHECK_VALUE(offsets[num_bags] <= num_indices, "cnr::mark_rows: offsets end at ", offsets[num_bags],
                    " but there are only ", num_indices, " indices");
}

template <typename index_t, typename offset_t>
void mark_rows_kernel(const index_t* indices, const offset_t* offsets, const std::vector<int64_t>& feature_bags,
                      const int64_t* hsc, const int64_t* rows_per_table, uint64_t* words, int32_t* counts,
                      int64_t* first_bad) {
  const int64_t T = static_cast<int64_t>(feature_bags.size()) - 1;
  // Index positions where each feature starts; T is small, so this is cheap.
  std::vector<int64_t> begin(T + 1);
  for (int64_t f = 0; f <= T; ++f) begin[f] = static_cast<int64_t>(offsets[feature_bags[f]]);
  const int64_t lo = begin[0], hi = begin[T];
  if (hi - lo <= kGrain || at::get_num_threads() == 1) {
    // One chunk: no other thread touches the words, so plain ORs suffice.
    *first_bad = mark_span<false>(indices, begin, hsc, rows_per_table, words, counts, lo, hi);
    return;
  }
  std::atomic<int64_t> bad{INT64_MAX};
  at::parallel_for(lo, hi, kGrain, [&](int64_t c0, int64_t c1) {
    const int64_t local_bad = mark_span<true>(indices, begin, hsc, rows_per_table, words, counts, c0, c1);
    int64_t seen = bad.load();
    while (local_bad < seen && !bad.compare_exchange_weak(seen, local_bad)) {
    }
  });
  *first_bad = bad.load();
}

void mark_rows_cpu(const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& hash_size_cumsum,
                   const at::Tensor& rows_per_table, const at::Tensor& bitmap, const std::optional<at::Tensor>& counts,
                   const std::optional<at::Tensor>& B_offsets) {
  const MarkRowsShape shape =
      check_mark_rows_args(indices, offsets, hash_size_cumsum, rows_per_table, bitmap, counts, B_offsets);
  const int64_t T = shape.num_features, num_bags = shape.num_bags;
  const auto hsc_t = hash_size_cumsum.contiguous();
  const auto rows_t = rows_per_table.contiguous();
  const int64_t* hsc = hsc_t.data_ptr<int64_t>();
  const int64_t* rows = rows_t.data_ptr<int64_t>();
  // Features of one table share its base row and size; every feature's table must fit the bitmap.
  for (int64_t f = 0; f < T; ++f) {
    TORCH_CHECK(hsc[f] >= 0 && rows[f] >= 0 && hsc[f] + rows[f] <= shape.row_limit, "cnr::mark_rows: feature ", f,
                "'s table spans rows [", hsc[f], ", ", hsc[f] + rows[f], ") but the bitmap",
                counts ? " and counts hold " : " holds ", shape.row_limit,
                " rows; pass the TBE's own hash_size_cumsum and rows_per_table");
  }

  std::vector<int64_t> feature_bags(T + 1);
  if (B_offsets) {
    const auto b = B_offsets->to(at::kLong).contiguous();
    std::copy_n(b.data_ptr<int64_t>(), T + 1, feature_bags.begin());
    TORCH_CHECK(feature_bags[T] == num_bags, "cnr::mark_rows: B_offsets ends at ", feature_bags[T], " but offsets has ",
                num_bags, " bags");
    TORCH_CHECK(feature_bags[0] == 0 && std::is_sorted(feature_bags.begin(), feature_bags.end()),
                "cnr::mark_rows: B_offsets must start at 0 and never decrease");
  } else {
    if (num_bags <= 0) return;  // empty batch
    TORCH_CHECK(num_bags % T == 0, "cnr::mark_rows: offsets has ", num_bags, " bags, not a multiple of the ", T,
                " features; pass B_offsets for variable batch sizes");
    for (int64_t f = 0; f <= T; ++f) feature_bags[f] = f * (num_bags / T);
  }
  if (num_bags <= 0) return;

  const auto idx = indices.contiguous();
  const auto off = offsets.contiguous();
  int64_t first_bad = INT64_MAX;
  int32_t* counts_ptr = counts ? counts->data_ptr<int32_t>() : nullptr;
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "cnr::mark_rows", [&] {
    using id_t = index_t;
    AT_DISPATCH_INDEX_TYPES(off.scalar_type(), "cnr::mark_rows", [&] {
      check_bag_layout(off.data_ptr<index_t>(), num_bags, idx.numel());
      mark_rows_kernel<id_t, index_t>(idx.data_ptr<id_t>(), off.data_ptr<index_t>(), feature_bags, hsc, rows,
                                      words_of(bitmap), counts_ptr, &first_bad);
    });
  });
  if (first_bad != INT64_MAX) {
    const int64_t f = [&] {
      // Recover the feature of the first bad position for the message.
      const auto o = off.to(at::kLong);
      const int64_t* op = o.data_ptr<int64_t>();
      int64_t g = 0;
      while (g + 1 < T && op[feature_bags[g + 1]] <= first_bad) ++g;
      return g;
    }();
    TORCH_CHECK_INDEX(false, "cnr::mark_rows: id ", idx.to(at::kLong)[first_bad].item<int64_t>(),
                      " looked up in feature ", f, " is outside its table's ", rows[f],
                      " local rows; check the input ids against the table's num_embeddings");
  }
}

at::Tensor bitmap_to_rows_cpu(const at::Tensor& bitmap, int64_t start, int64_t end) {
  check_bitmap(bitmap, "bitmap_to_rows");
  check_range(bitmap, start, end, "bitmap_to_rows");
  const uint64_t* words = words_of(bitmap);
  // Two passes over fixed chunks of words: count, then write at the scanned offsets.
  constexpr int64_t kChunkRows = 1 << 16;
  const int64_t chunks = (end - start + kChunkRows - 1) / kChunkRows;
  std::vector<int64_t> offs(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      offs[c + 1] = count_bits(words, start + c * kChunkRows, std::min(end, start + (c + 1) * kChunkRows));
  });
  for (int64_t c = 0; c < chunks; ++c) offs[c + 1] += offs[c];
  auto out = at::empty({offs[chunks]}, bitmap.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = start + c * kChunkRows, hi = std::min(end, lo + kChunkRows);
      int64_t* p = dst + offs[c];
      for (int64_t w = lo >> 6; w <= (hi - 1) >> 6; ++w) {
        uint64_t bits = words[w];
        if (w == (lo >> 6)) bits &= ~0ull << (lo & 63);
        if (w == ((hi - 1) >> 6)) bits &= ~0ull >> (63 - ((hi - 1) & 63));
        while (bits) {
          *p++ = (w << 6) + __builtin_ctzll(bits);
          bits &= bits - 1;
        }
      }
    }
  });
  return out;
}

at::Tensor bitmap_count_cpu(const at::Tensor& bitmap, const at::Tensor& boundaries) {
  check_bitmap(bitmap, "bitmap_count");
  const auto b = boundaries.to(at::kLong).contiguous();
  const int64_t* bp = b.data_ptr<int64_t>();
  const int64_t R = std::max<int64_t>(b.numel() - 1, 0);
  for (int64_t r = 0; r < R; ++r) check_range(bitmap, bp[r], bp[r + 1], "bitmap_count");
  auto out = at::empty({R}, bitmap.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const uint64_t* words = words_of(bitmap);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = count_bits(words, bp[r], bp[r + 1]);
  });
  return out;
}

void bitmap_clear_cpu(const at::Tensor& bitmap, int64_t start, int64_t end) {
  check_bitmap(bitmap, "bitmap_clear_");
  check_range(bitmap, start, end, "bitmap_clear_");
  if (start >= end) return;
  uint64_t* words = words_of(bitmap);
  const int64_t w0 = start >> 6, w1 = (end - 1) >> 6;
  const uint64_t head = ~0ull << (start & 63);
  const uint64_t tail = ~0ull >> (63 - ((end - 1) & 63));
  if (w0 == w1) {
    words[w0] &= ~(head & tail);
    return;
  }
  words[w0] &= ~head;
  words[w1] &= ~tail;
  if (w1 > w0 + 1) std::fill(words + w0 + 1, words + w1, 0ull);
}

}  // namespace
}  // namespace cnr

TORCH_LIBRARY_IMPL(cnr, CPU, m) {
  m.impl("mark_rows", &cnr::mark_rows_cpu);
  m.impl("bitmap_to_rows", &cnr::bitmap_to_rows_cpu);
  m.impl("bitmap_count", &cnr::bitmap_count_cpu);
  m.impl("bitmap_clear_", &cnr::bitmap_clear_cpu);
}
