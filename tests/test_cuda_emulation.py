"""Our CUDA kernels, run on the CPU under the CUDA emulation, against their CPU twins.

``torch.ops.cnr_emu.<op>`` is the CUDA binding of ``<op>`` (csrc/cuda/*_bind.cpp) with its
kernels (csrc/cuda/*.cu) compiled as host C++ against csrc/cuda_emu/, which runs each
block's threads as fibers in an order drawn from CNR_CUDA_EMU_SEED; ``torch.ops.cnr.<op>``
is the CPU kernel. Both get the same inputs, and their outputs must be bit-identical
(floats compared as bits, so NaN and -0 count) except where a test states a tolerance and
why. Bad calls must raise the same exception type from both. The emulation itself is
tested in test_cuda_emulator.py.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from cnr_torchrec import _cuda_emu
from cnr_torchrec import ops as cnr_ops

emu = _cuda_emu.load()
cpu = torch.ops.cnr

BITS = (2, 3, 4, 8)
INT_MAX = 2**31 - 1


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t


def assert_identical(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
    if not torch.equal(_bits(got), _bits(want)):
        differ = (_bits(got) != _bits(want)).sum().item()
        raise AssertionError(f"{what}: {differ} of {_bits(want).numel()} bytes differ")


def assert_all_identical(got, want, what: str = "") -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_identical(g, w, f"{what} output {i}")


def outcome(fn):
    """(result, None) or (None, exception type): both backends must end the same way."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return None, type(e)


# ---- dirty-row tracking ------------------------------------------------------------

# Features 0, 3 and 6 share table 0, features 2 and 5 table 2: a real TBE's layout.
TABLE_ROWS = [100, 1, 700, 64, 3000]
FEATURE_TABLE_MAP = [0, 1, 2, 0, 3, 2, 0, 4]
NUM_ROWS = sum(TABLE_ROWS)
T = len(FEATURE_TABLE_MAP)


@pytest.fixture(scope="module")
def layout() -> tuple[torch.Tensor, torch.Tensor]:
    """The TBE's own hash_size_cumsum and rows_per_table (one entry per feature)."""
    specs = [(rows, 4, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in TABLE_ROWS]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=FEATURE_TABLE_MAP,
                                                optimizer=EmbOptimType.EXACT_SGD)
    return tbe.hash_size_cumsum.clone(), tbe.rows_per_table.clone()


def random_lookup(seed, batch=40, max_pool=12, index_dtype=torch.int64, offset_dtype=torch.int64, vbe=False,
                  pruned=0.05):
    """Feature-major ids and bag offsets; with vbe, each feature has its own batch size (some none)."""
    g = torch.Generator().manual_seed(seed)
    bags = torch.randint(0, batch + 1, (T,), generator=g).tolist() if vbe else [batch] * T
    if vbe:
        bags[1] = 0
    lengths = [torch.randint(0, max_pool + 1, (b,), generator=g) for b in bags]
    ids = [torch.randint(0, TABLE_ROWS[t], (int(n.sum()),), generator=g) for t, n in zip(FEATURE_TABLE_MAP, lengths)]
    indices = torch.cat(ids)
    indices[torch.rand(indices.numel(), generator=g) < pruned] = -1
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
    b_offsets = torch.tensor([0] + bags).cumsum(0) if vbe else None
    return indices.to(index_dtype), offsets.to(offset_dtype), b_offsets


def mark_both(layout, indices, offsets, b_offsets=None, counts_init=None, record=False, bitmap_rows=NUM_ROWS):
    """mark_rows on both backends from equal starting state: (bitmap, counts, record, exception type) each."""
    results = []
    for backend in (emu, cpu):
        bitmap = torch.zeros(cnr_ops.bitmap_words(bitmap_rows), dtype=torch.int64)
        counts = None if counts_init is None else counts_init.clone()
        errors = cnr_ops.lookup_record() if record else None
        _, exc = outcome(lambda: backend.mark_rows(indices, offsets, *layout, bitmap, counts, b_offsets, errors))
        results.append((bitmap, counts, errors, exc))
    return results


def assert_same_marks(got, want):
    assert got[3] == want[3], f"emulated CUDA raised {got[3]}, CPU {want[3]}"
    for i, what in enumerate(("bitmap", "counts", "errors record")):
        if want[i] is not None:
            assert_identical(got[i], want[i], what)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("vbe", [False, True])
def test_mark_rows_matches_cpu_on_shared_tables(layout, index_dtype, offset_dtype, vbe):
    # About 10k ids: 40 blocks of the mark kernel, whose atomics meet on shared rows and words.
    indices, offsets, b_offsets = random_lookup(1, batch=200, index_dtype=index_dtype, offset_dtype=offset_dtype,
                                                vbe=vbe)
    counts = torch.zeros(NUM_ROWS, dtype=torch.int32)
    for record in (False, True):
        got, want = mark_both(layout, indices, offsets, b_offsets, counts, record)
        assert_same_marks(got, want)
        assert want[3] is None and int(want[1].sum()) == int((indices != -1).sum())
    # Ids outside their tables, spread over the blocks: the same first one and count are recorded.
    bad = indices.clone()
    positions = torch.randperm(bad.numel(), generator=torch.Generator().manual_seed(2))[:9]
    bad[positions] = torch.tensor([5000, -2, 100, 700, 1, 64, 3000, -9, 2**30], dtype=bad.dtype)
    for record in (False, True):
        got, want = mark_both(layout, bad, offsets, b_offsets, counts, record)
        assert_same_marks(got, want)
    assert cnr_ops.first_bad_id(want[2]) is not None


def _bad(indices, offsets, **kw):
    return dict(indices=torch.tensor(indices), offsets=torch.tensor(offsets), **kw)


# Lookups with problems, for 2 features of one table of 100 rows (hsc [0, 0, 100]).
PROBLEMS = {
    "id past its table": _bad([3, 100, 5, 200], [0, 2, 4]),
    "negative ids other than -1": _bad([-1, -2, 5, -7], [0, 2, 4]),
    "first offset negative": _bad([1, 2, 3], [-1, 1, 3]),
    "offsets decrease": _bad([1, 2, 3], [0, 2, 1]),
    "offsets past the ids": _bad([1, 2, 3], [0, 1, 9]),
    "B_offsets out of order": _bad([1, 2, 3], [0, 1, 2, 3], b_offsets=torch.tensor([0, 2, 1])),
    "B_offsets not ending at the bags": _bad([1, 2, 3], [0, 1, 2, 3], b_offsets=torch.tensor([0, 1, 2])),
    "table past the bitmap": _bad([1, 2], [0, 1, 2], hsc=torch.tensor([0, 50, 150])),
    "no ids": _bad([], [0, 0, 0]),
    "no bags": _bad([], [0]),
    "ids past the last offset": _bad([1, 2, 3, 4], [0, 1, 2]),
}


@pytest.mark.parametrize("case", PROBLEMS)
def test_mark_rows_reports_the_same_problems_as_cpu(case):
    p = PROBLEMS[case]
    lay = (p.get("hsc", torch.tensor([0, 0, 100])), torch.tensor([100, 100]))
    idx = p["indices"].long()
    for record in (False, True):
        got, want = mark_both(lay, idx, p["offsets"].long(), p.get("b_offsets"), None, record, bitmap_rows=128)
        assert_same_marks(got, want)
        if record:  # the record raises the same way on both
            raised = [outcome(lambda: backend.raise_lookup_errors(r[2]))[1] for backend, r in ((emu, got), (cpu, want))]
            assert raised[0] == raised[1]


def test_mark_rows_errors_record_accumulates_like_cpu(layout):
    good, off, _ = random_lookup(2)
    bad = good.clone()
    bad[7], bad[20] = 5000, -3
    records = []
    for backend in (emu, cpu):
        bitmap, errors = torch.zeros(cnr_ops.bitmap_words(NUM_ROWS), dtype=torch.int64), cnr_ops.lookup_record()
        for ids in (good, bad, good, bad):
            backend.mark_rows(ids, off, layout[0], layout[1], bitmap, None, None, errors)
        records.append((bitmap, errors))
    assert_identical(records[0][0], records[1][0], "bitmap")
    assert_identical(records[0][1], records[1][1], "record")
    assert cnr_ops.first_bad_id(records[1][1])[3] == 4


def test_mark_rows_counts_saturate_like_cpu(layout):
    indices, offsets, _ = random_lookup(3, batch=60, max_pool=30, pruned=0.0)
    counts = torch.full((NUM_ROWS,), INT_MAX - 2, dtype=torch.int32)
    got, want = mark_both(layout, indices, offsets, counts_init=counts)
    assert_same_marks(got, want)
    assert int(want[1].max()) == INT_MAX


def random_bitmap(words: int, seed: int, density: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = (torch.rand(words * 64, generator=g) < density).view(words, 64).long()
    return (bits << torch.arange(64)).sum(1)  # wraps into the sign bit as int64 does


RANGES = [(0, 0), (37, 37), (0, 1), (5, 60), (63, 65), (64, 128), (1, 639), (100, 577), (0, 640)]


@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_bitmap_ops_match_cpu_on_ranges_that_start_and_end_mid_word(density):
    bitmap = random_bitmap(10, 4, density)
    for start, end in RANGES:
        before = emu.host_reads()
        assert_identical(emu.bitmap_to_rows(bitmap, start, end), cpu.bitmap_to_rows(bitmap, start, end),
                         f"bitmap_to_rows [{start}, {end})")
        # The output's size is the number of set bits: one read on the host, none for an empty range.
        assert emu.host_reads() - before == (1 if end > start else 0)
        cleared = [bitmap.clone(), bitmap.clone()]
        emu.bitmap_clear_(cleared[0], start, end)
        cpu.bitmap_clear_(cleared[1], start, end)
        assert_identical(cleared[0], cleared[1], f"bitmap_clear_ [{start}, {end})")
    bounds = torch.tensor([0, 0, 1, 5, 60, 63, 65, 127, 128, 129, 400, 639, 640])
    assert_identical(emu.bitmap_count(bitmap, bounds), cpu.bitmap_count(bitmap, bounds), "bitmap_count")
    for empty in (torch.tensor([3]), torch.zeros(0, dtype=torch.int64)):
        assert_identical(emu.bitmap_count(bitmap, empty), cpu.bitmap_count(bitmap, empty), "no ranges")


def test_bitmap_count_matches_cpu_on_ranges_wider_than_a_block():
    # One block of 256 threads per range: a range of 700 words makes each thread sum several.
    bitmap = random_bitmap(800, 5, 0.3)
    bounds = torch.tensor([3, 44_803, 44_900, 51_199])
    assert_identical(emu.bitmap_count(bitmap, bounds), cpu.bitmap_count(bitmap, bounds), "bitmap_count")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_scatter_rows_matches_cpu(dtype):
    g = torch.Generator().manual_seed(6)
    src = (torch.randn(50, 7, generator=g) * 100).to(dtype)
    index = torch.randperm(80, generator=g)[:50]
    index[::6] = -1  # skipped rows
    base = (torch.randn(80, 9, generator=g) * 100).to(dtype)
    outs = [base.clone()[:, 1:8], base.clone()[:, 1:8]]  # a column slice: the row stride is free
    emu.scatter_rows_(outs[0], index, src)
    cpu.scatter_rows_(outs[1], index, src)
    assert_identical(outs[0], outs[1], "out")
    emu.scatter_rows_(outs[0], index[:0], src[:0])
    assert_identical(outs[0], outs[1], "out after an empty scatter")


# ---- row codecs ------------------------------------------------------------------------


def row_zoo(dim: int, seed: int = 0) -> torch.Tensor:
    """Rows an encoder must handle: every scale, ties, constants, zeros, -0, NaN, Inf, float16 overflow."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e-7, 1e-4, 0.01, 1.0, 30.0, 1e4, 1e5])
    rows = [torch.randn(len(scales), dim, generator=g) * scales[:, None]]
    rows.append(torch.randn(6, dim, generator=g).round() / 4)  # values on a grid: ties in rounding
    rows.append(torch.rand(4, dim, generator=g) * torch.tensor([1.0, -1.0, 60000.0, 1e-6])[:, None])
    special = torch.zeros(7, dim)
    special[1] = 2.5  # constant
    special[2] = -0.0
    special[3, 0] = float("nan")
    special[4, -1] = float("inf")
    special[5, ::2] = 3.0  # two values: 0 and 3
    special[6] = -7.0
    rows.append(special)
    return torch.cat(rows)


DIMS = (1, 5, 33, 70)


@pytest.mark.parametrize("bits", BITS)
def test_pack_and_unpack_bits_match_cpu(bits):
    g = torch.Generator().manual_seed(bits)
    for dim in (1, 3, 7, 8, 9, 17, 64, 70):
        codes = torch.randint(0, 2**bits, (5, dim), generator=g, dtype=torch.uint8)
        packed = cpu.pack_bits(codes, bits)
        assert_identical(emu.pack_bits(codes, bits), packed, f"pack_bits dim {dim}")
        assert_identical(emu.unpack_bits(packed, bits, dim), cpu.unpack_bits(packed, bits, dim), f"unpack dim {dim}")
        junk = torch.randint(0, 256, packed.shape, generator=g, dtype=torch.uint8)  # padding bits set too
        assert_identical(emu.unpack_bits(junk, bits, dim), cpu.unpack_bits(junk, bits, dim), f"unpack junk {dim}")
    empty = torch.zeros(0, 9, dtype=torch.uint8)
    assert_identical(emu.pack_bits(empty, bits), cpu.pack_bits(empty, bits), "no rows")


def sixteen_bit_boundaries(dtype: torch.dtype) -> torch.Tensor:
    """Every value of a 16-bit format, the midpoints to its neighbours, and a float32 ulp either side."""
    all16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    all16 = all16[torch.isfinite(all16)].unique()
    mid = (all16[:-1].double() + all16[1:].double()) / 2  # exact in float32 for both formats
    mid = mid.float()
    ulp = torch.nextafter(mid, torch.tensor(float("inf"))) - mid
    return torch.cat([all16, mid, mid + ulp, mid - ulp, torch.tensor([65504.0, 65519.99, 65520.0, 1e38, -1e38])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cast_rows_rounds_like_cpu_and_torch(dtype):
    values = sixteen_bit_boundaries(torch.float16 if dtype != torch.bfloat16 else torch.bfloat16)
    values = torch.cat([values, torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 1e-6])
    pad = (-values.numel()) % 512
    rows = torch.cat([values, torch.zeros(pad)]).view(-1, 512)
    payload, status = emu.cast_rows(rows, dtype)
    assert_all_identical((payload, status), cpu.cast_rows(rows, dtype), "cast_rows")
    # Round to nearest even, subnormals included, as torch's own cast (rows that overflow are zeroed).
    fits = status == 0
    assert_identical(payload.view(dtype).view(rows.shape)[fits], rows[fits].to(dtype), "against torch")
    assert fits.float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cast_rows_flags_and_zeroes_rows_like_cpu(dtype):
    rows = row_zoo(33)
    payload, status = emu.cast_rows(rows, dtype)
    assert_all_identical((payload, status), cpu.cast_rows(rows, dtype), "cast_rows")
    assert (status == 1).sum() == 2 and (payload[status != 0] == 0).all()


def grids_for(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Searched grids, with a NaN, a negative and an overflowing one mixed in."""
    bias, scale = cpu.adaptive_search(rows, 4, 16, 0.7, 0)
    bias, scale = bias.clone(), scale.clone()
    bias[1], scale[2], scale[3] = float("nan"), -1.0, 1e9
    return bias, scale


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("param_dtypes", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                          (torch.float16, torch.float32)])
def test_uniform_quantization_matches_cpu(bits, symmetric, param_dtypes):
    for dim in DIMS:
        rows = row_zoo(dim, seed=dim)
        grids = [(None, None)] if symmetric else [(None, None), grids_for(rows)]
        for gb, gs in grids:
            args = (rows, bits, symmetric, *param_dtypes, gb, gs)
            encoded = cpu.quantize_uniform(*args)
            assert_all_identical(emu.quantize_uniform(*args), encoded, f"quantize_uniform dim {dim}")
            payload, scale, bias, _ = encoded
            b = None if symmetric else bias
            assert_identical(emu.dequantize_uniform(payload, scale, b, bits, dim),
                             cpu.dequantize_uniform(payload, scale, b, bits, dim), f"dequantize dim {dim}")


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_uniform_matches_cpu_on_any_payload(bits):
    g = torch.Generator().manual_seed(bits)
    for dim, dtype in ((3, torch.float16), (17, torch.float32), (64, torch.float16)):
        payload = torch.randint(0, 256, (40, (dim * bits + 7) // 8), generator=g, dtype=torch.uint8)
        scale = (torch.rand(40, generator=g) * 3).to(dtype)
        for bias in (None, (torch.randn(40, generator=g) * 5).to(dtype)):
            assert_identical(emu.dequantize_uniform(payload, scale, bias, bits, dim),
                             cpu.dequantize_uniform(payload, scale, bias, bits, dim), f"dim {dim}")
            rows = torch.randperm(60, generator=g)[:40]
            rows[::3] = -1  # skipped
            start = torch.randn(60, dim, generator=g)
            for accumulate in (False, True):  # written, or added (a residual chain's restore)
                outs = [start.clone(), start.clone()]
                emu.dequantize_uniform_into_(payload, scale, bias, bits, rows, outs[0], accumulate)
                cpu.dequantize_uniform_into_(payload, scale, bias, bits, rows, outs[1], accumulate)
                assert_identical(outs[0], outs[1], f"dequantize_uniform_into_ dim {dim} accumulate {accumulate}")


def test_float16_parameters_round_down_and_up_like_cpu():
    # The stored bias rounds down and the scale up (__float2half_rd / _ru): two-value rows
    # over every float16 magnitude, subnormals and the overflow edge included.
    g = torch.Generator().manual_seed(9)
    lo = torch.randn(3000, generator=g) * torch.logspace(-9, 5, 3000)
    hi = lo + torch.rand(3000, generator=g) * torch.logspace(-8, 4.9, 3000)
    rows = torch.stack([lo, hi], 1)
    for bits in (2, 8):
        args = (rows, bits, False, torch.float16, torch.float16, None, None)
        assert_all_identical(emu.quantize_uniform(*args), cpu.quantize_uniform(*args), f"{bits} bits")


def _search_error(rows, bias, scale, bits):
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((rows - bias[:, None]) * inv[:, None]).round().clamp(0, 2**bits - 1)
    return ((bias[:, None] + scale[:, None] * q - rows) ** 2).sum(1)


def _span(rows: torch.Tensor) -> torch.Tensor:
    return (rows.amax(1) - rows.amin(1)).nan_to_num(0.0).clamp_min(1e-30)


@pytest.mark.parametrize("bits", BITS)
def test_adaptive_search_matches_cpu_up_to_near_ties(bits):
    g = torch.Generator().manual_seed(bits)
    rows = torch.cat([row_zoo(40, seed=1), torch.randn(100, 40, generator=g) * torch.rand(100, 1, generator=g)])
    for num_bins, ratio in ((16, 0.5), (50, 0.2)):
        # Each greedy move compares two errors, summed in another order on each backend (a
        # warp tree, vector lanes): where they tie to float precision the move, and so the
        # grid, may differ. Measured over 12528 rows (2-8 bits, D 8-128): 16 rows (0.13%),
        # whose two grids' errors differ by at most 6.5e-7 (relative). Allowed: 1% of rows,
        # and 1e-5. The quantization on a grid is exact, so adaptive_quantize differs only there.
        got, want = (backend.adaptive_search(rows, bits, num_bins, ratio, 0) for backend in (emu, cpu))
        tied = _assert_near_ties(rows, got, want, bits)
        args = (rows, bits, num_bins, ratio, 0, torch.float16, torch.float32)
        assert_all_identical([t[~tied] for t in emu.adaptive_quantize(*args)],
                             [t[~tied] for t in cpu.adaptive_quantize(*args)], "adaptive_quantize")
        # Refits solve the normal equations in double from float sums on CUDA, in float on
        # the CPU: nearly every refit grid differs in its last bits (90% of the rows above).
        # From equal greedy grids, measured: bias and scale within 5.6e-4 of the row's range,
        # the grid's squared error within 2.3%, 0.2% of the codes moved (by one). Allowed:
        # 1e-3, 5%, 1% and one (rows that tied above start elsewhere and are not compared).
        got, want = (backend.adaptive_search(rows, bits, num_bins, ratio, 3) for backend in (emu, cpu))
        nan = want[0].isnan()
        assert torch.equal(got[0].isnan(), nan) and torch.equal(got[1].isnan(), nan)
        same = ~nan & ~tied
        x, span = rows[same], _span(rows[same])
        for g_, w_ in zip(got, want):
            assert ((g_[same] - w_[same]).abs() <= 1e-3 * span).all()
        e_got, e_want = (_search_error(x, r[0][same], r[1][same], bits) for r in (got, want))
        assert ((e_got - e_want).abs() <= 0.05 * e_want + 1e-30).all()
        args = (rows, bits, num_bins, ratio, 3, torch.float16, torch.float32)
        codes = [cpu.unpack_bits(backend.adaptive_quantize(*args)[0], bits, 40).int() for backend in (emu, cpu)]
        moved = codes[0][same] != codes[1][same]
        assert (codes[0][same] - codes[1][same]).abs().max() <= 1 and moved.float().mean() <= 0.01


def _assert_near_ties(rows, got, want, bits) -> torch.Tensor:
    """The rows whose greedy grids differ, after checking both grids are equally good."""
    nan = want[0].isnan()
    assert torch.equal(got[0].isnan(), nan) and torch.equal(got[1].isnan(), nan)
    tied = ~nan & ((got[0] != want[0]) | (got[1] != want[1]))
    assert tied.float().mean() <= 0.01
    if tied.any():
        e_got, e_want = (_search_error(rows[tied], r[0][tied], r[1][tied], bits) for r in (got, want))
        assert ((e_got - e_want).abs() <= 1e-5 * e_want).all()
    return tied


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("codebook_dtype", [torch.float32, torch.float16])
def test_kmeans_matches_cpu(bits, codebook_dtype):
    g = torch.Generator().manual_seed(bits)
    for dim in (3, 2**bits, 40, 300):
        if bits == 8 and dim == 300:
            rows = torch.randn(4, dim, generator=g)  # 255 clusters a pass: keep it short
        else:
            rows = torch.cat([row_zoo(dim, seed=dim), torch.randn(20, dim, generator=g)])
        grid = grids_for(rows)
        for iters, gb, gs in ((0, None, None), (3, None, None), (2, *grid)):
            encoded = cpu.kmeans_quantize(rows, bits, iters, codebook_dtype, gb, gs)
            got = emu.kmeans_quantize(rows, bits, iters, codebook_dtype, gb, gs)
            if iters == 0 or dim <= 2**bits:  # no Lloyd pass: nothing is summed
                assert_all_identical(got, encoded, f"kmeans dim {dim}")
            else:
                assert_kmeans_close(rows, got, encoded, bits, codebook_dtype)
            payload, bias, codebook, _ = encoded
            assert_identical(emu.dequantize_codebook(payload, bias, codebook, bits, dim),
                             cpu.dequantize_codebook(payload, bias, codebook, bits, dim), "dequantize_codebook")


def assert_kmeans_close(rows, got, want, bits, codebook_dtype):
    """Lloyd's cluster sums run in another order (warp trees, one loop), so centroids differ
    in their last bits, and a value at a cluster boundary may fall on the other side.
    Measured over 4062 rows (2-8 bits, D 20-300, 1-8 passes): 97.5% within 1e-5 of the
    row's range, 3 rows beyond 1e-4 (at most 2.2e-3: a value changed cluster in an earlier
    pass), 18 of 1.04M codes moved, by one. Allowed: every row within 1e-2 of its range,
    99% within 1e-4, plus one float16 step of a stored offset; 0.5% of codes, by one."""
    assert_identical(got[3], want[3], "status")
    ok = want[3] == 0
    span = _span(rows[ok])
    cb_got, cb_want = got[2][ok].float(), want[2][ok].float()
    step = (cb_want.abs() * 2.0**-10 + 2.0**-24) if codebook_dtype == torch.float16 else torch.zeros_like(cb_want)
    off = torch.maximum((got[1][ok] - want[1][ok]).abs() / span,
                        (((cb_got - cb_want).abs() - step).clamp_min(0) / span[:, None]).amax(1))
    assert (off <= 1e-2).all() and (off > 1e-4).float().mean() <= 0.01, f"centroids: worst {off.max():.2e}"
    codes = [cpu.unpack_bits(p, bits, rows.shape[1]).int() for p in (got[0], want[0])]
    moved = codes[0] != codes[1]
    assert (codes[0] - codes[1]).abs().max() <= 1 and moved.float().mean() <= 0.005


def test_dequantize_codebook_raises_on_corrupt_codes_like_cpu():
    payload = cpu.pack_bits(torch.tensor([[0, 1, 2, 7, 3]], dtype=torch.uint8), 3)
    bias, codebook = torch.zeros(1), torch.ones(1, 4)  # 5 centroids: code 7 is past them
    before = emu.host_reads()
    assert outcome(lambda: emu.dequantize_codebook(payload, bias, codebook, 3, 5))[1] is ValueError
    assert outcome(lambda: cpu.dequantize_codebook(payload, bias, codebook, 3, 5))[1] is ValueError
    assert emu.host_reads() - before == 1  # the flag is read back once


# ---- bad calls ----------------------------------------------------------------------------

_X = torch.randn(4, 10)
_PAY = torch.zeros(4, 4, dtype=torch.uint8)  # 10 codes of 3 bits
_ONES, _ZEROS = torch.ones(4), torch.zeros(4)
_BM = torch.zeros(1, dtype=torch.int64)
_HSC, _RPT = torch.tensor([0, 10, 20]), torch.tensor([10, 10])

BAD_CALLS = {
    "pack_bits bits 5": lambda o: o.pack_bits(_PAY, 5),
    "pack_bits code too big": lambda o: o.pack_bits(_PAY + 4, 2),
    "pack_bits int32 codes": lambda o: o.pack_bits(_PAY.int(), 2),
    "unpack_bits wrong width": lambda o: o.unpack_bits(_PAY, 3, 20),
    "cast_rows to int": lambda o: o.cast_rows(_X, torch.int32),
    "cast_rows float64 rows": lambda o: o.cast_rows(_X.double(), torch.float16),
    "cast_rows no columns": lambda o: o.cast_rows(torch.zeros(3, 0), torch.float16),
    "quantize bfloat16 scale": lambda o: o.quantize_uniform(_X, 4, False, torch.bfloat16, torch.float32),
    "quantize half a grid": lambda o: o.quantize_uniform(_X, 4, False, torch.float32, torch.float32, _ZEROS, None),
    "quantize symmetric grid": lambda o: o.quantize_uniform(_X, 4, True, torch.float32, torch.float32, _ZEROS, _ONES),
    "quantize short grid": lambda o: o.quantize_uniform(_X, 4, False, torch.float32, torch.float32, _ZEROS[:2],
                                                        _ONES[:2]),
    "dequantize short scale": lambda o: o.dequantize_uniform(_PAY, _ONES[:2], _ZEROS, 3, 10),
    "dequantize int scale": lambda o: o.dequantize_uniform(_PAY, _ONES.int(), _ZEROS, 3, 10),
    "dequantize_into rows past out": lambda o: o.dequantize_uniform_into_(
        _PAY, _ONES, _ZEROS, 3, torch.tensor([0, 1, 2, 9]), torch.zeros(4, 10)),
    "dequantize_into a row twice, accumulating": lambda o: o.dequantize_uniform_into_(
        _PAY, _ONES, _ZEROS, 3, torch.tensor([0, 1, 1, 3]), torch.zeros(4, 10), True),
    "dequantize_into float64 out": lambda o: o.dequantize_uniform_into_(
        _PAY, _ONES, _ZEROS, 3, torch.arange(4), torch.zeros(4, 10, dtype=torch.float64)),
    "adaptive no bins": lambda o: o.adaptive_search(_X, 4, 0, 0.5, 1),
    "adaptive ratio 2": lambda o: o.adaptive_search(_X, 4, 10, 2.0, 1),
    "adaptive negative refits": lambda o: o.adaptive_search(_X, 4, 10, 0.5, -1),
    "kmeans negative iters": lambda o: o.kmeans_quantize(_X, 3, -1, torch.float32),
    "kmeans bfloat16 codebook": lambda o: o.kmeans_quantize(_X, 3, 1, torch.bfloat16),
    "codebook too wide": lambda o: o.dequantize_codebook(_PAY, _ZEROS, torch.zeros(4, 8), 3, 10),
    "codebook float16 bias": lambda o: o.dequantize_codebook(_PAY, _ZEROS.half(), torch.zeros(4, 7), 3, 10),
    "scatter index past out": lambda o: o.scatter_rows_(torch.zeros(4, 3), torch.tensor([0, 5]), torch.ones(2, 3)),
    "scatter float64 src": lambda o: o.scatter_rows_(torch.zeros(4, 3), torch.tensor([0, 1]),
                                                     torch.ones(2, 3, dtype=torch.float64)),
    "scatter int32 index": lambda o: o.scatter_rows_(torch.zeros(4, 3), torch.tensor([0, 1], dtype=torch.int32),
                                                     torch.ones(2, 3)),
    "scatter strided columns": lambda o: o.scatter_rows_(torch.zeros(3, 4).t(), torch.tensor([0, 1]),
                                                         torch.ones(2, 3)),
    "bitmap_to_rows past the bitmap": lambda o: o.bitmap_to_rows(_BM, 0, 65),
    "bitmap_to_rows inverted": lambda o: o.bitmap_to_rows(_BM, 5, 3),
    "bitmap_to_rows int32 bitmap": lambda o: o.bitmap_to_rows(_BM.int(), 0, 5),
    "bitmap_count decreasing": lambda o: o.bitmap_count(_BM, torch.tensor([10, 5])),
    "bitmap_count 2-D": lambda o: o.bitmap_count(_BM, torch.tensor([[0, 5]])),
    "bitmap_clear_ past the bitmap": lambda o: o.bitmap_clear_(_BM, 0, 65),
    "mark_rows float ids": lambda o: o.mark_rows(torch.tensor([3.0, 1.0]), torch.tensor([0, 1, 2]), _HSC, _RPT, _BM),
    "mark_rows bags not per feature": lambda o: o.mark_rows(torch.tensor([3, 1]), torch.tensor([0, 1]), _HSC, _RPT,
                                                            _BM),
    "mark_rows short record": lambda o: o.mark_rows(torch.tensor([3, 1]), torch.tensor([0, 1, 2]), _HSC, _RPT, _BM,
                                                    None, None, torch.zeros(3, dtype=torch.int64)),
    "mark_rows short counts": lambda o: o.mark_rows(torch.tensor([3, 15]), torch.tensor([0, 1, 2]), _HSC, _RPT,
                                                    _BM.clone(), torch.zeros(12, dtype=torch.int32)),
    "raise_lookup_errors short record": lambda o: o.raise_lookup_errors(torch.zeros(3, dtype=torch.int64)),
}


def raised(fn) -> tuple[type, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return type(e), str(e)
    return None


@pytest.mark.parametrize("call", BAD_CALLS)
def test_bad_calls_raise_the_same_error_and_message(call):
    # Both backends run one shared checker per op (csrc/tracking_checks.h, csrc/codecs_checks.h).
    got, want = raised(lambda: BAD_CALLS[call](emu)), raised(lambda: BAD_CALLS[call](cpu))
    assert want is not None, "the CPU kernel accepts this call: not a bad call"
    assert got == want


# ---- what the emulation adds: thread orders and host reads ----------------------------------


def test_seed_changes_the_thread_order_but_not_our_kernels_results(layout):
    racy = []
    for seed in ("1", "2"):
        with mock.patch.dict(os.environ, {"CNR_CUDA_EMU_SEED": seed}):
            racy.append(emu.selftest("racy"))
    assert not torch.equal(racy[0], racy[1]), "the seed does not change the order threads run in"

    rows = torch.cat([row_zoo(40), torch.randn(30, 40, generator=torch.Generator().manual_seed(8))])
    indices, offsets, _ = random_lookup(8)
    bitmap = random_bitmap(60, 8, 0.3)

    def run_all():
        counts = torch.zeros(NUM_ROWS, dtype=torch.int32)
        bm = torch.zeros(cnr_ops.bitmap_words(NUM_ROWS), dtype=torch.int64)
        emu.mark_rows(indices, offsets, layout[0], layout[1], bm, counts)
        return [bm, counts, emu.bitmap_count(bitmap, torch.tensor([0, 100, 3000, 3840])),
                *emu.kmeans_quantize(rows, 3, 4, torch.float16), *emu.adaptive_search(rows, 4, 20, 0.5, 2),
                *emu.quantize_uniform(rows, 3, True, torch.float16, torch.float32), *emu.cast_rows(rows, torch.float16)]

    results = []
    for seed in ("3", "4"):
        with mock.patch.dict(os.environ, {"CNR_CUDA_EMU_SEED": seed}):
            results.append(run_all())
    assert_all_identical(results[0], results[1], "seed 3 vs seed 4")


def test_host_reads_count_what_the_bindings_read_back(layout):
    indices, offsets, _ = random_lookup(9)
    bm = torch.zeros(cnr_ops.bitmap_words(NUM_ROWS), dtype=torch.int64)
    record = cnr_ops.lookup_record()
    rows = torch.randn(8, 16)
    calls = [
        (0, lambda: emu.mark_rows(indices, offsets, layout[0], layout[1], bm, None, None, record)),  # the hot path
        (1, lambda: emu.mark_rows(indices, offsets, layout[0], layout[1], bm)),  # raises at once: reads its record
        (1, lambda: emu.raise_lookup_errors(record)),
        (0, lambda: emu.bitmap_clear_(bm, 3, 900)),
        (0, lambda: emu.quantize_uniform(rows, 4, False, torch.float16, torch.float16)),
        (0, lambda: emu.kmeans_quantize(rows, 2, 2, torch.float32)),
    ]
    for reads, call in calls:
        before = emu.host_reads()
        call()
        assert emu.host_reads() - before == reads
