"""torch.ops.cnr.scatter_rows_ against ATen's index_copy_."""

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


def test_index_out_of_range_writes_nothing():
    out = torch.zeros(10, 4)
    with pytest.raises(IndexError, match="index 10 at position 1 is outside out's 10 rows"):
        ops.scatter_rows_(out, torch.tensor([2, 10]), torch.ones(2, 4))
    with pytest.raises(IndexError, match="index -1"):
        ops.scatter_rows_(out, torch.tensor([-1]), torch.ones(1, 4))
    assert not out.any()


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
def test_bad_arguments(out, index, src, match):
    with pytest.raises(ValueError, match=match):
        ops.scatter_rows_(out, index, src)


def test_opcheck():
    out, index, src = torch.zeros(20, 8), torch.tensor([3, 0, 19]), torch.rand(3, 8)
    torch.library.opcheck(torch.ops.cnr.scatter_rows_.default, (out, index, src))
