// CPU kernels of the dirty-row tracking ops: one bit per flat TBE row, packed
// into int64 words. Threads that hit the same word meet in a relaxed atomic OR;
// a plain load first skips the atomic for rows that are already dirty, which is
// the common case under Zipf-skewed ids.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <mutex>

#include "../tracking_checks.h"

namespace cnr {
namespace {

constexpr int64_t kGrain = 1 << 14;

inline uint64_t* words_of(const at::Tensor& bitmap) {
  return reinterpret_cast<uint64_t*>(bitmap.data_ptr<int64_t>());
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

// Ids outside their table in a span: how many, and the first position (INT64_MAX if none).
struct BadIds {
  int64_t count = 0;
  int64_t first = INT64_MAX;
  void add(const BadIds& o) {
    count += o.count;
    first = std::min(first, o.first);
  }
};

// Marks positions [lo, hi) of the feature-major index array. Each feature's run is
// handled with its base row and its table's size in registers. An id of -1 is a
// pruned row, which FBGEMM's lookups skip: it is skipped here too, in the branch
// that catches bad ids, so the common path has no extra test. With kAtomic,
// concurrent chunks share words: a plain load skips the atomic OR for rows
// already marked.
template <bool kAtomic, typename index_t>
BadIds mark_span(const index_t* indices, const std::vector<int64_t>& begin, const int64_t* hsc,
                 const int64_t* rows_per_table, uint64_t* words, int32_t* counts, int64_t lo, int64_t hi) {
  BadIds bad;
  int64_t f = std::upper_bound(begin.begin(), begin.end(), lo) - begin.begin() - 1;
  for (int64_t i = lo; i < hi; ++f) {
    const int64_t stop = std::min(hi, begin[f + 1]);
    const int64_t base = hsc[f];
    const uint64_t size = static_cast<uint64_t>(rows_per_table[f]);
    for (; i < stop; ++i) {
      const int64_t id = static_cast<int64_t>(indices[i]);
      if (static_cast<uint64_t>(id) >= size) {  // also catches negative ids
        if (id != -1) bad.add({1, i});
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

// The row layout: every feature's table lies within the bitmap (and counts).
void check_tables(const int64_t* hsc, const int64_t* rows, int64_t T, int64_t row_limit, int64_t* record) {
  using namespace lookup_record;
  for (int64_t f = 0; f < T; ++f) {
    if (hsc[f] >= 0 && rows[f] >= 0 && hsc[f] + rows[f] <= row_limit) continue;
    if (record[kBadTables]++ == 0) {
      record[kFirstBadTable] = INT64_MAX - f;
      record[kTableStart] = hsc[f];
      record[kTableRows] = rows[f];
      record[kRowLimit] = row_limit;
    }
  }
}

// Bag b reads indices [offsets[b], offsets[b + 1]). A TBE lookup trusts that
// layout, and the ids checked here are those between the first and last offsets,
// so the layout is checked too: that makes this pass a full bounds check of the
// lookup, with the verdicts of FBGEMM's bounds_check_indices in FATAL mode.
template <typename offset_t>
void check_bag_layout(const offset_t* offsets, int64_t num_bags, int64_t num_indices, int64_t* record) {
  using namespace lookup_record;
  for (int64_t b = 0; b <= num_bags; ++b) {
    const int64_t at = static_cast<int64_t>(offsets[b]);
    const bool bad = (b == 0 && at < 0) || (b < num_bags && static_cast<int64_t>(offsets[b + 1]) < at) ||
                     (b == num_bags && at > num_indices);
    if (!bad || record[kBadBags]++ > 0) continue;
    record[kFirstBadBag] = INT64_MAX - b;
    record[kBagStart] = at;
    record[kBagEnd] = b < num_bags ? static_cast<int64_t>(offsets[b + 1]) : 0;
  }
}

template <typename index_t, typename offset_t>
BadIds mark_rows_kernel(const index_t* indices, const offset_t* offsets, const std::vector<int64_t>& feature_bags,
                        const int64_t* hsc, const int64_t* rows_per_table, uint64_t* words, int32_t* counts) {
  const int64_t T = static_cast<int64_t>(feature_bags.size()) - 1;
  // Index positions where each feature starts; T is small, so this is cheap.
  std::vector<int64_t> begin(T + 1);
  for (int64_t f = 0; f <= T; ++f) begin[f] = static_cast<int64_t>(offsets[feature_bags[f]]);
  const int64_t lo = begin[0], hi = begin[T];
  if (hi - lo <= kGrain || at::get_num_threads() == 1) {
    // One chunk: no other thread touches the words, so plain ORs suffice.
    return mark_span<false>(indices, begin, hsc, rows_per_table, words, counts, lo, hi);
  }
  std::mutex mu;
  BadIds bad;
  at::parallel_for(lo, hi, kGrain, [&](int64_t c0, int64_t c1) {
    const BadIds local = mark_span<true>(indices, begin, hsc, rows_per_table, words, counts, c0, c1);
    if (local.count == 0) return;
    const std::lock_guard<std::mutex> lock(mu);
    bad.add(local);
  });
  return bad;
}

// Fills the record of one lookup, marking its rows unless the record stops it.
template <typename index_t, typename offset_t>
void mark_checked(const index_t* idx, int64_t num_indices, const offset_t* off, const MarkRowsShape& shape,
                  const int64_t* b_offsets, const int64_t* hsc, const int64_t* rows, uint64_t* words,
                  int32_t* counts, int64_t* record) {
  using namespace lookup_record;
  const int64_t T = shape.num_features, num_bags = shape.num_bags;
  record[kNumBags] = num_bags;
  record[kNumIndices] = num_indices;
  check_tables(hsc, rows, T, shape.row_limit, record);
  std::vector<int64_t> feature_bags(T + 1);
  for (int64_t f = 0; f <= T; ++f) {
    feature_bags[f] = b_offsets ? b_offsets[f] : f * (num_bags / T);
    const bool bad = b_offsets && ((f == 0 && b_offsets[0] != 0) || (f > 0 && b_offsets[f] < b_offsets[f - 1]) ||
                                   (f == T && b_offsets[T] != num_bags));
    record[kBadBatchOffsets] += bad;
  }
  if (num_bags > 0) check_bag_layout(off, num_bags, num_indices, record);
  if (num_bags == 0 || stops_lookup(record)) return;
  const BadIds bad = mark_rows_kernel<index_t, offset_t>(idx, off, feature_bags, hsc, rows, words, counts);
  if (bad.count == 0) return;
  // The feature of the first bad position: the last one that starts at or before it.
  int64_t f = 0;
  while (f + 1 < T && static_cast<int64_t>(off[feature_bags[f + 1]]) <= bad.first) ++f;
  record[kBadIds] = bad.count;
  record[kFirstBadAt] = INT64_MAX - bad.first;
  record[kBadId] = static_cast<int64_t>(idx[bad.first]);
  record[kBadFeature] = f;
  record[kBadFeatureRows] = rows[f];
}

void mark_rows_cpu(const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& hash_size_cumsum,
                   const at::Tensor& rows_per_table, const at::Tensor& bitmap, const std::optional<at::Tensor>& counts,
                   const std::optional<at::Tensor>& B_offsets, const std::optional<at::Tensor>& errors) {
  const MarkRowsShape shape =
      check_mark_rows_args(indices, offsets, hash_size_cumsum, rows_per_table, bitmap, counts, B_offsets, errors);
  const auto hsc = hash_size_cumsum.contiguous();
  const auto rows = rows_per_table.contiguous();
  const auto b = B_offsets ? B_offsets->contiguous() : at::Tensor();
  const auto idx = indices.contiguous();
  const auto off = offsets.contiguous();
  int64_t record[kLookupRecordSize] = {};
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "cnr::mark_rows", [&] {
    using id_t = index_t;
    AT_DISPATCH_INDEX_TYPES(off.scalar_type(), "cnr::mark_rows", [&] {
      mark_checked(idx.data_ptr<id_t>(), idx.numel(), off.data_ptr<index_t>(), shape,
                   B_offsets ? b.data_ptr<int64_t>() : nullptr, hsc.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
                   words_of(bitmap), counts ? counts->data_ptr<int32_t>() : nullptr, record);
    });
  });
  if (errors) {
    lookup_record::merge(record, errors->data_ptr<int64_t>());
  } else {
    raise_lookup_errors(record);
  }
}

void raise_lookup_errors_cpu(const at::Tensor& errors) {
  TORCH_CHECK(errors.dtype() == at::kLong && errors.numel() == kLookupRecordSize,
              "cnr::raise_lookup_errors: errors must be the int64 record of ", kLookupRecordSize,
              " entries that mark_rows filled");
  raise_lookup_errors(errors.contiguous().data_ptr<int64_t>());
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
  const auto b = boundaries.to(at::kLong).contiguous();
  check_count_ranges(bitmap, b);
  const int64_t* bp = b.data_ptr<int64_t>();
  const int64_t R = std::max<int64_t>(b.numel() - 1, 0);
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
  m.impl("raise_lookup_errors", &cnr::raise_lookup_errors_cpu);
  m.impl("bitmap_to_rows", &cnr::bitmap_to_rows_cpu);
  m.impl("bitmap_count", &cnr::bitmap_count_cpu);
  m.impl("bitmap_clear_", &cnr::bitmap_clear_cpu);
}
