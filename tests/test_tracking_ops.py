"""The torch.ops.cnr dirty-row ops against pure-torch references."""

import pytest
import torch

from cnr_torchrec import ops


def _bitmap(num_rows: int) -> torch.Tensor:
    return torch.zeros(ops.bitmap_words(num_rows), dtype=torch.int64)


def _set_rows(bitmap: torch.Tensor) -> torch.Tensor:
    return ops.reference_bitmap_to_rows(bitmap, 0, bitmap.numel() * 64)


def _random_lookup(gen, sizes, batch, max_pool, index_dtype=torch.int64, offset_dtype=torch.int64, B_per=None):
    T = len(sizes)
    bags = B_per if B_per is not None else [batch] * T
    lengths = [torch.randint(0, max_pool + 1, (b,), generator=gen) for b in bags]
    ids = [torch.randint(0, sizes[f], (int(lengths[f].sum()),), generator=gen) for f in range(T)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
    hsc = torch.tensor([0] + list(sizes), dtype=torch.int64).cumsum(0)
    return torch.cat(ids).to(index_dtype), offsets.to(offset_dtype), hsc


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("threads", [1, 2])
def test_mark_rows_matches_reference(index_dtype, offset_dtype, threads):
    gen = torch.Generator().manual_seed(0)
    sizes = [100, 1, 700, 64, 3000]  # includes a 1-row table and a word-aligned one
    indices, offsets, hsc = _random_lookup(gen, sizes, batch=300, max_pool=40, index_dtype=index_dtype,
                                           offset_dtype=offset_dtype)
    total = int(hsc[-1])
    bitmap, counts = _bitmap(total), torch.zeros(total, dtype=torch.int32)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.mark_rows(indices, offsets, hsc, bitmap, counts)
    finally:
        torch.set_num_threads(prev)
    ref_mask, ref_counts = ops.reference_mark_rows(indices, offsets, hsc, total)
    assert torch.equal(_set_rows(bitmap), torch.nonzero(ref_mask).flatten())
    assert torch.equal(counts.long(), ref_counts)


def test_mark_rows_repeated_ids_hit_one_word_from_many_threads():
    # Every index lands in the same 64-bit word: concurrent ORs must not lose bits.
    n = 200_000
    indices = torch.arange(n, dtype=torch.int64) % 64
    offsets = torch.tensor([0, n], dtype=torch.int64)
    hsc = torch.tensor([0, 64], dtype=torch.int64)
    bitmap, counts = _bitmap(64), torch.zeros(64, dtype=torch.int32)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ops.mark_rows(indices, offsets, hsc, bitmap, counts)
    finally:
        torch.set_num_threads(prev)
    assert int(bitmap[0]) == -1  # all 64 bits set
    assert torch.equal(counts, torch.full((64,), n // 64, dtype=torch.int32))


def test_mark_rows_accumulates_across_calls():
    hsc = torch.tensor([0, 10, 30], dtype=torch.int64)
    bitmap = _bitmap(30)
    ops.mark_rows(torch.tensor([1, 2]), torch.tensor([0, 1, 2]), hsc, bitmap)
    ops.mark_rows(torch.tensor([9, 19]), torch.tensor([0, 1, 2]), hsc, bitmap)
    assert _set_rows(bitmap).tolist() == [1, 9, 12, 29]


def test_mark_rows_empty_batch_marks_nothing():
    hsc = torch.tensor([0, 10, 30], dtype=torch.int64)
    bitmap, counts = _bitmap(30), torch.zeros(30, dtype=torch.int32)
    ops.mark_rows(torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), hsc, bitmap, counts)
    ops.mark_rows(torch.empty(0, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), hsc, bitmap, counts)
    assert int(bitmap.abs().sum()) == 0 and int(counts.sum()) == 0


def test_mark_rows_variable_batch_per_feature():
    gen = torch.Generator().manual_seed(3)
    sizes, B_per = [50, 80, 20], [3, 7, 1]
    indices, offsets, hsc = _random_lookup(gen, sizes, batch=0, max_pool=6, B_per=B_per)
    B_offsets = torch.tensor([0] + B_per).cumsum(0)
    bitmap = _bitmap(150)
    ops.mark_rows(indices, offsets, hsc, bitmap, None, B_offsets)
    ref_mask, _ = ops.reference_mark_rows(indices, offsets, hsc, 150, B_offsets)
    assert torch.equal(_set_rows(bitmap), torch.nonzero(ref_mask).flatten())


def test_mark_rows_counts_saturate():
    hsc = torch.tensor([0, 4], dtype=torch.int64)
    counts = torch.tensor([2**31 - 2, 0, 0, 0], dtype=torch.int32)
    ops.mark_rows(torch.tensor([0, 0, 0, 1]), torch.tensor([0, 4]), hsc, _bitmap(4), counts)
    assert counts.tolist() == [2**31 - 1, 1, 0, 0]


@pytest.mark.parametrize("bad", [-1, 10])
def test_mark_rows_out_of_range_names_feature(bad):
    hsc = torch.tensor([0, 5, 15], dtype=torch.int64)
    bitmap = _bitmap(15)
    with pytest.raises(IndexError, match="feature 1"):
        ops.mark_rows(torch.tensor([0, 3, bad]), torch.tensor([0, 1, 3]), hsc, bitmap)


def test_mark_rows_rejects_bad_layout():
    hsc = torch.tensor([0, 5, 15], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.mark_rows(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3]), hsc, _bitmap(15))
    with pytest.raises(RuntimeError, match="bitmap holds"):
        ops.mark_rows(torch.tensor([0]), torch.tensor([0, 1, 1]), torch.tensor([0, 100, 200]), _bitmap(15))


@pytest.mark.parametrize(
    "offsets,match",
    [([-1, 1, 3], "start at -1"), ([0, 2, 1], "decrease at bag 1 \\(2 then 1\\)"), ([0, 1, 4], "end at 4")],
)
def test_mark_rows_rejects_a_bad_bag_layout_before_marking(offsets, match):
    # The pass is a full bounds check of the lookup: offsets the TBE would read out of bounds are errors.
    hsc = torch.tensor([0, 5, 15], dtype=torch.int64)
    for dtype in (torch.int32, torch.int64):
        bitmap = _bitmap(15)
        with pytest.raises(ValueError, match=match):
            ops.mark_rows(torch.tensor([0, 3, 4]), torch.tensor(offsets, dtype=dtype), hsc, bitmap)
        assert not bitmap.any()  # nothing marked
    with pytest.raises(RuntimeError, match="B_offsets must start at 0"):
        ops.mark_rows(torch.tensor([0, 3, 4]), torch.tensor([0, 1, 3]), hsc, _bitmap(15), None, torch.tensor([1, 0, 2]))


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
    ops.mark_rows(rows, torch.tensor([0, rows.numel()]), torch.tensor([0, num_rows]), bitmap)
    assert torch.equal(ops.bitmap_to_rows(bitmap, 0, num_rows), rows)
    assert int(ops.bitmap_count(bitmap, torch.tensor([0, num_rows]))[0]) == rows.numel()


def test_bitmap_ops_reject_bad_ranges():
    bitmap = _bitmap(64)
    with pytest.raises(RuntimeError, match="outside the bitmap"):
        ops.bitmap_to_rows(bitmap, 0, 65)
    with pytest.raises(RuntimeError, match="outside the bitmap"):
        ops.bitmap_clear_(bitmap, 5, 2)
    with pytest.raises(RuntimeError, match="int64"):
        ops.bitmap_count(bitmap.int(), torch.tensor([0, 1]))


def test_opcheck():
    hsc = torch.tensor([0, 10, 30], dtype=torch.int64)
    bitmap = _bitmap(30)
    idx, off = torch.tensor([1, 2, 15, 3]), torch.tensor([0, 1, 2, 3, 4])
    torch.library.opcheck(torch.ops.cnr.mark_rows.default, (idx, off, hsc, bitmap, torch.zeros(30, dtype=torch.int32)))
    torch.library.opcheck(torch.ops.cnr.mark_rows.default, (idx.int(), off.int(), hsc, bitmap, None, None))
    torch.library.opcheck(torch.ops.cnr.bitmap_to_rows.default, (bitmap, 0, 30))
    torch.library.opcheck(torch.ops.cnr.bitmap_count.default, (bitmap, torch.tensor([0, 5, 30])))
    torch.library.opcheck(torch.ops.cnr.bitmap_clear_.default, (bitmap.clone(), 3, 17))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(7)
    sizes = [100, 1, 700, 64, 3000]
    indices, offsets, hsc = _random_lookup(gen, sizes, batch=300, max_pool=40)
    total = int(hsc[-1])
    cpu_bits, cpu_counts = _bitmap(total), torch.zeros(total, dtype=torch.int32)
    ops.mark_rows(indices, offsets, hsc, cpu_bits, cpu_counts)
    gpu_bits, gpu_counts = cpu_bits.new_zeros(cpu_bits.shape).cuda(), cpu_counts.new_zeros(total).cuda()
    for idt in (torch.int32, torch.int64):
        gpu_bits.zero_(), gpu_counts.zero_()
        ops.mark_rows(indices.to(idt).cuda(), offsets.to(idt).cuda(), hsc.cuda(), gpu_bits, gpu_counts)
        assert torch.equal(gpu_bits.cpu(), cpu_bits) and torch.equal(gpu_counts.cpu(), cpu_counts)
    assert torch.equal(ops.bitmap_to_rows(gpu_bits, 5, total - 3).cpu(), ops.bitmap_to_rows(cpu_bits, 5, total - 3))
    bounds = torch.tensor([0, 100, 101, 801, total])
    assert torch.equal(ops.bitmap_count(gpu_bits, bounds.cuda()).cpu(), ops.bitmap_count(cpu_bits, bounds))
    ops.bitmap_clear_(gpu_bits, 7, 900), ops.bitmap_clear_(cpu_bits, 7, 900)
    assert torch.equal(gpu_bits.cpu(), cpu_bits)
    with pytest.raises(IndexError):
        ops.mark_rows(torch.tensor([0, 5000]).cuda(), torch.tensor([0, 1, 2]).cuda(), torch.tensor([0, 10, 20]).cuda(),
                      gpu_bits)
