"""The torch.ops.cnr dirty-row ops against references built from FBGEMM's own definitions.

``mark_rows`` gets its row layout from a real FBGEMM TBE (``hash_size_cumsum`` and
``rows_per_table``, per feature); the reference gets only the TBE's spec (rows per
table, feature_table_map). Its verdicts on bad input are compared with FBGEMM's
``bounds_check_indices``, and its marks with the rows whose weights a real TBE
update changed.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from cnr_torchrec import ops

# Tables of 100, 1, 700, 64 and 3000 rows (a 1-row table, a word-aligned one); features
# 0, 3 and 6 share table 0, features 2 and 5 table 2, so shared tables are the common case.
TABLE_ROWS = [100, 1, 700, 64, 3000]
FEATURE_TABLE_MAP = [0, 1, 2, 0, 3, 2, 0, 4]


def _bitmap(num_rows: int) -> torch.Tensor:
    return torch.zeros(ops.bitmap_words(num_rows), dtype=torch.int64)


def _set_rows(bitmap: torch.Tensor) -> torch.Tensor:
    return ops.reference_bitmap_to_rows(bitmap, 0, bitmap.numel() * 64)


def _tbe(table_rows=TABLE_ROWS, ftm=FEATURE_TABLE_MAP, dim=4, **kwargs) -> SplitTableBatchedEmbeddingBagsCodegen:
    specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in table_rows]
    kwargs.setdefault("optimizer", EmbOptimType.EXACT_SGD)
    return SplitTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=list(ftm), learning_rate=0.1, **kwargs)


def _random_lookup(gen, table_rows, ftm, batch, max_pool, index_dtype=torch.int64, offset_dtype=torch.int64,
                   B_per=None, pruned=0.0):
    bags = B_per if B_per is not None else [batch] * len(ftm)
    lengths = [torch.randint(0, max_pool + 1, (b,), generator=gen) for b in bags]
    ids = [torch.randint(0, table_rows[t], (int(n.sum()),), generator=gen) for t, n in zip(ftm, lengths)]
    indices = torch.cat(ids)
    if pruned:
        indices[torch.rand(indices.numel(), generator=gen) < pruned] = -1
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
    return indices.to(index_dtype), offsets.to(offset_dtype)


def _mark(tbe, indices, offsets, counts=None, B_offsets=None) -> torch.Tensor:
    bitmap = _bitmap(int(tbe.hash_size_cumsum[-1]))
    ops.mark_rows(indices, offsets, tbe.hash_size_cumsum, tbe.rows_per_table, bitmap, counts, B_offsets)
    return bitmap


def _with_threads(n, fn):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("threads", [1, 2])
def test_mark_rows_matches_reference_with_shared_tables(index_dtype, offset_dtype, threads):
    gen = torch.Generator().manual_seed(0)
    tbe = _tbe()
    indices, offsets = _random_lookup(gen, TABLE_ROWS, FEATURE_TABLE_MAP, batch=300, max_pool=40,
                                      index_dtype=index_dtype, offset_dtype=offset_dtype, pruned=0.05)
    counts = torch.zeros(sum(TABLE_ROWS), dtype=torch.int32)
    bitmap = _with_threads(threads, lambda: _mark(tbe, indices, offsets, counts))
    ref_mask, ref_counts = ops.reference_mark_rows(indices, offsets, TABLE_ROWS, FEATURE_TABLE_MAP)
    assert torch.equal(_set_rows(bitmap), torch.nonzero(ref_mask).flatten())
    assert torch.equal(counts.long(), ref_counts)
    # Every table's rows were reached through more than one feature, so sharing was exercised.
    assert ref_mask[:100].sum() > 50 and ref_mask[101:801].sum() > 300


def test_mark_rows_equals_the_rows_a_tbe_update_changes():
    # Weights diffed before and after a real FBGEMM step (EXACT_SGD, a loss whose gradient
    # is nonzero on every looked-up row) against the marks of the same lookup.
    gen = torch.Generator().manual_seed(11)
    tbe = _tbe()
    for w in tbe.split_embedding_weights():
        w.uniform_(-1, 1, generator=gen)
    indices, offsets = _random_lookup(gen, TABLE_ROWS, FEATURE_TABLE_MAP, batch=50, max_pool=6)
    before = torch.cat([w.clone() for w in tbe.split_embedding_weights()])
    tbe(indices, offsets).sum().backward()
    after = torch.cat(list(tbe.split_embedding_weights()))
    changed = torch.nonzero((after != before).any(dim=1)).flatten()
    assert torch.equal(_set_rows(_mark(tbe, indices, offsets)), changed)


@pytest.mark.parametrize("seed", range(6))
def test_mark_rows_rejects_exactly_what_fbgemm_bounds_check_rejects(seed):
    # FBGEMM's bounds_check_indices in FATAL mode is the judge: ids outside their table
    # (including other negatives) are errors; -1 is a pruned row and passes.
    gen = torch.Generator().manual_seed(seed)
    tbe = _tbe()
    indices, offsets = _random_lookup(gen, TABLE_ROWS, FEATURE_TABLE_MAP, batch=20, max_pool=5, pruned=0.1)
    if seed % 3 == 1:
        indices[int(torch.randint(0, indices.numel(), (1,), generator=gen))] = TABLE_ROWS[0]  # past table 0 ...
    elif seed % 3 == 2:
        indices[int(torch.randint(0, indices.numel(), (1,), generator=gen))] = -2
    warning = torch.zeros(1, dtype=torch.int64)
    try:
        torch.ops.fbgemm.bounds_check_indices(tbe.rows_per_table, indices.clone(), offsets.clone(),
                                              BoundsCheckMode.FATAL.value, warning, None)
        fbgemm_ok = True
    except RuntimeError:
        fbgemm_ok = False
    try:
        _mark(tbe, indices, offsets)
        ours_ok = True
    except IndexError:
        ours_ok = False
    ref_ok = True
    try:
        ops.reference_mark_rows(indices, offsets, TABLE_ROWS, FEATURE_TABLE_MAP)
    except IndexError:
        ref_ok = False
    # ... which may still be in range when that position belongs to a feature of a larger table.
    assert ours_ok == fbgemm_ok == ref_ok


def test_mark_rows_skips_pruned_ids():
    tbe = _tbe([10, 7], [0, 1, 0])
    counts = torch.zeros(17, dtype=torch.int32)
    bitmap = _mark(tbe, torch.tensor([9, -1, 6, -1, 9]), torch.tensor([0, 1, 2, 3, 4, 4, 5]), counts)
    assert _set_rows(bitmap).tolist() == [9, 16]
    assert counts[9] == 2 and counts.sum() == 3


def test_mark_rows_repeated_ids_hit_one_word_from_many_threads():
    # Every index lands in the same 64-bit word: concurrent ORs must not lose bits.
    n = 200_000
    tbe = _tbe([64], [0])
    indices = torch.arange(n, dtype=torch.int64) % 64
    counts = torch.zeros(64, dtype=torch.int32)
    bitmap = _with_threads(2, lambda: _mark(tbe, indices, torch.tensor([0, n]), counts))
    assert int(bitmap[0]) == -1  # all 64 bits set
    assert torch.equal(counts, torch.full((64,), n // 64, dtype=torch.int32))


def test_mark_rows_accumulates_across_calls():
    tbe = _tbe([10, 20], [0, 1])
    bitmap = _bitmap(30)
    for ids in ([1, 2], [9, 19]):
        ops.mark_rows(torch.tensor(ids), torch.tensor([0, 1, 2]), tbe.hash_size_cumsum, tbe.rows_per_table, bitmap)
    assert _set_rows(bitmap).tolist() == [1, 9, 12, 29]


def test_mark_rows_empty_batch_marks_nothing():
    tbe = _tbe([10, 20], [0, 1])
    counts = torch.zeros(30, dtype=torch.int32)
    a = _mark(tbe, torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), counts)
    b = _mark(tbe, torch.empty(0, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), counts)
    assert not a.any() and not b.any() and int(counts.sum()) == 0


def test_mark_rows_variable_batch_per_feature():
    gen = torch.Generator().manual_seed(3)
    table_rows, ftm, B_per = [50, 80], [0, 1, 0], [3, 7, 1]
    tbe = _tbe(table_rows, ftm)
    indices, offsets = _random_lookup(gen, table_rows, ftm, batch=0, max_pool=6, B_per=B_per, pruned=0.1)
    B_offsets = torch.tensor([0] + B_per).cumsum(0)
    bitmap = _mark(tbe, indices, offsets, None, B_offsets)
    ref_mask, _ = ops.reference_mark_rows(indices, offsets, table_rows, ftm, B_offsets)
    assert torch.equal(_set_rows(bitmap), torch.nonzero(ref_mask).flatten())


def test_mark_rows_counts_saturate():
    tbe = _tbe([4], [0])
    counts = torch.tensor([2**31 - 2, 0, 0, 0], dtype=torch.int32)
    _mark(tbe, torch.tensor([0, 0, 0, 1]), torch.tensor([0, 4]), counts)
    assert counts.tolist() == [2**31 - 1, 1, 0, 0]


@pytest.mark.parametrize("bad", [-2, 5])
def test_mark_rows_out_of_range_names_feature(bad, backend):
    # Feature 2 reads table 0 (5 rows) after feature 1 read table 1 (10 rows).
    tbe = _tbe([5, 10], [0, 1, 0])
    with pytest.raises(IndexError, match="feature 2 is outside its table's 5 local rows"):
        backend.mark_rows(torch.tensor([0, 7, bad]), torch.tensor([0, 1, 2, 3]), tbe.hash_size_cumsum,
                          tbe.rows_per_table, _bitmap(15))


def test_mark_rows_rejects_bad_arguments(backend):
    tbe = _tbe([5, 10], [0, 1])
    hsc, rows = tbe.hash_size_cumsum, tbe.rows_per_table
    with pytest.raises(RuntimeError, match="multiple"):
        backend.mark_rows(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3]), hsc, rows, _bitmap(15))
    with pytest.raises(RuntimeError, match="feature 0.s table spans rows \\[0, 100\\) but the bitmap holds 64"):
        backend.mark_rows(torch.tensor([0]), torch.tensor([0, 1, 1]), torch.tensor([0, 100, 200]),
                          torch.tensor([100, 100]), _bitmap(15))
    with pytest.raises(RuntimeError, match="one entry per feature plus one"):
        backend.mark_rows(torch.tensor([0]), torch.tensor([0, 1, 1]), hsc[:2], rows, _bitmap(15))
    with pytest.raises(RuntimeError, match="int32 or int64"):
        backend.mark_rows(torch.tensor([0.0]), torch.tensor([0, 1, 1]), hsc, rows, _bitmap(15))


@pytest.mark.parametrize(
    "offsets,match",
    [([-1, 1, 3], "start at -1"), ([0, 2, 1], "decrease at bag 1 \\(2 then 1\\)"), ([0, 1, 4], "end at 4")],
)
def test_mark_rows_rejects_a_bad_bag_layout_before_marking(offsets, match, backend):
    # The pass is a full bounds check of the lookup: offsets the TBE would read out of bounds are errors.
    tbe = _tbe([5, 10], [0, 1])
    hsc, rows = tbe.hash_size_cumsum, tbe.rows_per_table
    for dtype in (torch.int32, torch.int64):
        bitmap = _bitmap(15)
        with pytest.raises(ValueError, match=match):
            backend.mark_rows(torch.tensor([0, 3, 4]), torch.tensor(offsets, dtype=dtype), hsc, rows, bitmap)
        assert not bitmap.any()  # nothing marked
    with pytest.raises(RuntimeError, match="B_offsets must start at 0"):
        backend.mark_rows(torch.tensor([0, 3, 4]), torch.tensor([0, 1, 3]), hsc, rows, _bitmap(15), None,
                          torch.tensor([1, 0, 2]))


@pytest.mark.parametrize("start,end", [(0, 0), (0, 1000), (3, 64), (64, 128), (5, 6), (63, 65), (100, 999)])
def test_bitmap_to_rows_count_and_clear(start, end):
    gen = torch.Generator().manual_seed(start * 1000 + end)
    bitmap = torch.randint(-(2**62), 2**62, (16,), generator=gen, dtype=torch.int64)
    ref = ops.reference_bitmap_to_rows(bitmap, start, end)
    assert torch.equal(ops.bitmap_to_rows(bitmap, start, end), ref)
    bounds = torch.tensor([0, start, end, 1024])
    counts = ops.bitmap_count(bitmap, bounds)
    all_rows = ops.reference_bitmap_to_rows(bitmap, 0, 1024)
    expect = [int(((all_rows >= a) & (all_rows < b)).sum()) for a, b in zip(bounds[:-1], bounds[1:])]
    assert counts.tolist() == expect
    ops.bitmap_clear_(bitmap, start, end)
    left = ops.reference_bitmap_to_rows(bitmap, 0, 1024)
    assert torch.equal(left, all_rows[(all_rows < start) | (all_rows >= end)])


def test_bitmap_to_rows_large_range_uses_all_chunks():
    num_rows = 1_000_003
    rows = torch.unique(torch.randint(0, num_rows, (50_000,), generator=torch.Generator().manual_seed(1)))
    bitmap = _bitmap(num_rows)
    ops.mark_rows(rows, torch.tensor([0, rows.numel()]), torch.tensor([0, num_rows]), torch.tensor([num_rows]), bitmap)
    assert torch.equal(ops.bitmap_to_rows(bitmap, 0, num_rows), rows)
    assert int(ops.bitmap_count(bitmap, torch.tensor([0, num_rows]))[0]) == rows.numel()


def test_bitmap_ops_reject_bad_ranges(backend):
    bitmap = _bitmap(64)
    with pytest.raises(RuntimeError, match="outside the bitmap"):
        backend.bitmap_to_rows(bitmap, 0, 65)
    with pytest.raises(RuntimeError, match="outside the bitmap"):
        backend.bitmap_clear_(bitmap, 5, 2)
    with pytest.raises(RuntimeError, match="int64"):
        backend.bitmap_count(bitmap.int(), torch.tensor([0, 1]))


def test_opcheck():
    tbe = _tbe([10, 20], [0, 1])
    hsc, rows = tbe.hash_size_cumsum, tbe.rows_per_table
    bitmap = _bitmap(30)
    idx, off = torch.tensor([1, 2, 15, 3]), torch.tensor([0, 1, 2, 3, 4])
    torch.library.opcheck(torch.ops.cnr.mark_rows.default,
                          (idx, off, hsc, rows, bitmap, torch.zeros(30, dtype=torch.int32)))
    torch.library.opcheck(torch.ops.cnr.mark_rows.default, (idx.int(), off.int(), hsc, rows, bitmap, None, None))
    torch.library.opcheck(torch.ops.cnr.bitmap_to_rows.default, (bitmap, 0, 30))
    torch.library.opcheck(torch.ops.cnr.bitmap_count.default, (bitmap, torch.tensor([0, 5, 30])))
    torch.library.opcheck(torch.ops.cnr.bitmap_clear_.default, (bitmap.clone(), 3, 17))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(7)
    tbe = _tbe()
    indices, offsets = _random_lookup(gen, TABLE_ROWS, FEATURE_TABLE_MAP, batch=300, max_pool=40, pruned=0.05)
    total = sum(TABLE_ROWS)
    cpu_counts = torch.zeros(total, dtype=torch.int32)
    cpu_bits = _mark(tbe, indices, offsets, cpu_counts)
    gpu_bits, gpu_counts = cpu_bits.new_zeros(cpu_bits.shape).cuda(), cpu_counts.new_zeros(total).cuda()
    hsc, rows = tbe.hash_size_cumsum.cuda(), tbe.rows_per_table.cuda()
    for idt in (torch.int32, torch.int64):
        gpu_bits.zero_(), gpu_counts.zero_()
        ops.mark_rows(indices.to(idt).cuda(), offsets.to(idt).cuda(), hsc, rows, gpu_bits, gpu_counts)
        assert torch.equal(gpu_bits.cpu(), cpu_bits) and torch.equal(gpu_counts.cpu(), cpu_counts)
    assert torch.equal(ops.bitmap_to_rows(gpu_bits, 5, total - 3).cpu(), ops.bitmap_to_rows(cpu_bits, 5, total - 3))
    bounds = torch.tensor([0, 100, 101, 801, total])
    assert torch.equal(ops.bitmap_count(gpu_bits, bounds.cuda()).cpu(), ops.bitmap_count(cpu_bits, bounds))
    ops.bitmap_clear_(gpu_bits, 7, 900), ops.bitmap_clear_(cpu_bits, 7, 900)
    assert torch.equal(gpu_bits.cpu(), cpu_bits)
    with pytest.raises(IndexError):
        ops.mark_rows(torch.tensor([0, 5000]).cuda(), torch.tensor([0, 1, 2]).cuda(), hsc[:3], rows[:2], gpu_bits)


def test_recorded_errors_raise_later_with_the_same_messages(backend):
    # With `errors`, mark_rows records instead of raising (no host sync on CUDA);
    # raise_lookup_errors then raises what the direct call would have raised.
    tbe = _tbe([5, 10], [0, 1, 0])
    hsc, rows = tbe.hash_size_cumsum, tbe.rows_per_table
    bad_ids = (torch.tensor([0, 7, 9, 1, -3]), torch.tensor([0, 1, 2, 5]))
    bad_layout = (torch.tensor([0, 3, 4]), torch.tensor([0, 2, 1, 3]))
    for indices, offsets in (bad_ids, bad_layout):
        with pytest.raises((IndexError, ValueError)) as direct:
            backend.mark_rows(indices, offsets, hsc, rows, _bitmap(15))
        errors, bitmap = ops.lookup_record(), _bitmap(15)
        backend.mark_rows(indices, offsets, hsc, rows, bitmap, errors=errors)
        with pytest.raises(type(direct.value)) as later:
            backend.raise_lookup_errors(errors)
        assert str(later.value) == str(direct.value)
    # Bad ids are skipped and the rest marked; a bad layout marks nothing.
    errors, bitmap = ops.lookup_record(), _bitmap(15)
    backend.mark_rows(*bad_ids, hsc, rows, bitmap, errors=errors)
    assert _set_rows(bitmap).tolist() == [0, 1, 5 + 7]
    bitmap = _bitmap(15)
    backend.mark_rows(*bad_layout, hsc, rows, bitmap, errors=ops.lookup_record())
    assert not bitmap.any()


def test_recorded_errors_keep_the_first_lookup_and_count_all(backend):
    tbe = _tbe([5, 10], [0, 1])
    hsc, rows = tbe.hash_size_cumsum, tbe.rows_per_table
    errors = ops.lookup_record()
    backend.mark_rows(torch.tensor([1, 2]), torch.tensor([0, 1, 2]), hsc, rows, _bitmap(15), errors=errors)
    backend.raise_lookup_errors(errors)  # a clean lookup records nothing
    backend.mark_rows(torch.tensor([6, 2]), torch.tensor([0, 1, 2]), hsc, rows, _bitmap(15), errors=errors)
    backend.mark_rows(torch.tensor([0, 12, 11]), torch.tensor([0, 1, 3]), hsc, rows, _bitmap(15), errors=errors)
    first = r"id 6 looked up in feature 0 is outside its table's 5 local rows \(3 bad ids\)"
    with pytest.raises(IndexError, match=first):
        backend.raise_lookup_errors(errors)
    with pytest.raises(RuntimeError, match="errors must be a contiguous int64 tensor of 17"):
        backend.mark_rows(torch.tensor([1]), torch.tensor([0, 1, 1]), hsc, rows, _bitmap(15),
                          errors=torch.zeros(16).long())


def test_first_bad_id_reads_the_record():
    tbe = _tbe([5, 10], [0, 1, 0])
    errors = ops.lookup_record()
    ops.mark_rows(torch.tensor([0, 7, 1, 9]), torch.tensor([0, 1, 2, 4]), tbe.hash_size_cumsum, tbe.rows_per_table,
                  _bitmap(15), errors=errors)
    assert ops.first_bad_id(errors) == (2, 9, 5, 1)
    assert ops.first_bad_id(ops.lookup_record()) is None
