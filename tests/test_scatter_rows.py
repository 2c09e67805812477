"""torch.ops.cnr.scatter_rows_ against ATen's index_copy_, and claim_rows_ against a pure-torch reference."""

import pytest
import torch

from cnr_torchrec import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_index_copy(dtype, threads):
    gen = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = (torch.rand(50_000, 24, generator=gen) * 100).to(dtype)
        index = torch.randperm(50_000, generator=gen)[:20_000]  # unsorted, no repeats
        src = (torch.rand(20_000, 24, generator=gen) * 100).to(dtype)
        expected = out.clone().index_copy_(0, index, src)
        ops.scatter_rows_(out, index, src)
        assert torch.equal(out, expected)
    finally:
        torch.set_num_threads(before)


def test_column_slice_and_row_slice():
    gen = torch.Generator().manual_seed(4)
    base = torch.rand(300, 64, generator=gen)
    index = torch.tensor([5, 0, 299, 17])
    src = torch.rand(4, 16, generator=gen)
    expected = base.clone()
    expected[:, 16:32].index_copy_(0, index, src)
    out = base.clone()
    ops.scatter_rows_(out[:, 16:32], index, src)
    assert torch.equal(out, expected)  # the other columns are untouched

    rows = torch.rand(1, 64, generator=gen).expand(2, 64)  # non-contiguous src is fine
    expected = base.clone()
    expected[100:200].index_copy_(0, index[:2], rows.contiguous())
    out = base.clone()
    ops.scatter_rows_(out[100:200], index[:2], rows)
    assert torch.equal(out, expected)


def test_empty():
    out = torch.rand(10, 4)
    before = out.clone()
    ops.scatter_rows_(out, torch.empty(0, dtype=torch.int64), torch.empty(0, 4))
    assert torch.equal(out, before)


def test_index_out_of_range_writes_nothing(backend):
    out = torch.zeros(10, 4)
    with pytest.raises(IndexError, match="index 10 at position 1 is outside out's 10 rows"):
        backend.scatter_rows_(out, torch.tensor([2, 10]), torch.ones(2, 4))
    with pytest.raises(IndexError, match="index 10 at position 2"):
        backend.scatter_rows_(out, torch.tensor([-1, 3, 10]), torch.ones(3, 4))
    assert not out.any()


def test_negative_index_skips_its_row():
    gen = torch.Generator().manual_seed(5)
    out = torch.rand(1000, 8, generator=gen)
    index = torch.randperm(1000, generator=gen)[:300]
    index[torch.rand(300, generator=gen) < 0.4] = -1
    src = torch.rand(300, 8, generator=gen)
    keep = index >= 0
    expected = out.clone().index_copy_(0, index[keep], src[keep])
    ops.scatter_rows_(out, index, src)
    assert torch.equal(out, expected)


def reference_claim(filled, offsets, count, lo, hi, shift):
    """claim_rows_ row by row in Python."""
    filled = filled.clone()
    out = []
    for p in range(count):
        o = int(offsets[p]) if offsets is not None else p
        if lo <= o < hi and not filled[o + shift]:
            filled[o + shift] = True
            out.append(o + shift)
        else:
            out.append(-1)
    return torch.tensor(out, dtype=torch.int64), filled


@pytest.mark.parametrize("with_offsets", [True, False])
@pytest.mark.parametrize("lo,hi,shift", [(0, 500, 0), (100, 350, -100), (-5, 10_000, 200), (300, 300, 0)])
def test_claim_rows_matches_reference(with_offsets, lo, hi, shift):
    gen = torch.Generator().manual_seed(6)
    rows = 500 + max(shift, 0)
    filled = torch.rand(rows, generator=gen) < 0.3
    if with_offsets:
        offsets = torch.randperm(500, generator=gen)[:200].sort().values
        count = 200
    else:
        offsets, count = None, 500
    if shift < 0:  # keep every row of [lo, hi) inside filled
        lo = max(lo, -shift)
    expected, expected_filled = reference_claim(filled, offsets, count, lo, hi, shift)
    got = ops.claim_rows_(filled, offsets, count, lo, hi, shift)
    assert torch.equal(got, expected)
    assert torch.equal(filled, expected_filled)
    # Claiming again finds nothing left.
    again = ops.claim_rows_(filled, offsets, count, lo, hi, shift)
    assert bool((again == -1).all())


def test_claim_rows_out_of_range_claims_nothing():
    filled = torch.zeros(10, dtype=torch.bool)
    with pytest.raises(IndexError, match="lands on row 10, outside the 10 rows"):
        ops.claim_rows_(filled, torch.tensor([2, 9]), 2, 0, 20, 1)
    assert not filled.any()
    # Rows outside [lo, hi) are never looked at, wherever they would land.
    got = ops.claim_rows_(filled, torch.tensor([2, 9]), 2, 0, 5, 1)
    assert got.tolist() == [3, -1] and filled.tolist() == [i == 3 for i in range(10)]


@pytest.mark.parametrize(
    "filled, offsets, count, match",
    [
        (torch.zeros(10, dtype=torch.uint8), None, 3, "bool"),
        (torch.zeros(10, dtype=torch.bool), torch.tensor([1, 2], dtype=torch.int32), 2, "int64"),
        (torch.zeros(10, dtype=torch.bool), torch.tensor([1, 2]), 3, "entries"),
        (torch.zeros(10, dtype=torch.bool), None, -1, ">= 0"),
    ],
)
def test_claim_rows_bad_arguments(filled, offsets, count, match):
    with pytest.raises(ValueError, match=match):
        ops.claim_rows_(filled, offsets, count, 0, 10, 0)


def test_claim_rows_opcheck():
    filled = torch.zeros(20, dtype=torch.bool)
    torch.library.opcheck(torch.ops.cnr.claim_rows_.default, (filled, torch.tensor([1, 5, 7]), 3, 0, 20, 2))
    torch.library.opcheck(torch.ops.cnr.claim_rows_.default, (filled, None, 4, 1, 3, 0))


@pytest.mark.parametrize(
    "out, index, src, match",
    [
        (torch.zeros(10, 4), torch.tensor([1]), torch.ones(1, 4, dtype=torch.float64), "cast src first"),
        (torch.zeros(10, 4), torch.tensor([1]), torch.ones(1, 3), "columns"),
        (torch.zeros(10, 4), torch.tensor([1, 2]), torch.ones(1, 4), "one entry per src row"),
        (torch.zeros(10, 4), torch.tensor([1], dtype=torch.int32), torch.ones(1, 4), "int64"),
        (torch.zeros(10), torch.tensor([1]), torch.ones(1), "2-D"),
        (torch.zeros(4, 10).t(), torch.tensor([1]), torch.ones(1, 4), "columns must be contiguous"),
    ],
)
def test_bad_arguments(out, index, src, match, backend):
    with pytest.raises(ValueError, match=match):
        backend.scatter_rows_(out, index, src)


def test_opcheck():
    out, index, src = torch.zeros(20, 8), torch.tensor([3, 0, 19]), torch.rand(3, 8)
    torch.library.opcheck(torch.ops.cnr.scatter_rows_.default, (out, index, src))
