"""Row codecs: kernels against the pure-torch references, round trips, accuracy on a
trained table, determinism, bad input, and torch.library.opcheck of every op."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from cnr_torchrec.quant import (
    METHODS,
    EncodedRows,
    EncodingFormatError,
    InvalidRowsError,
    NonFiniteRowsError,
    RowOverflowError,
    UnknownCodecError,
    decode,
    get_codec,
    rebuild,
)
from cnr_torchrec.quant import _reference as ref
from cnr_torchrec.quant import ops

BITS = (2, 3, 4, 8)
DIMS = (1, 3, 7, 8, 33, 128)
FLOAT_METHODS = ("none", "fp16", "bf16")
QUANT_METHODS = ("uniform_sym", "uniform_asym", "kmeans", "adaptive")


def all_codecs():
    """(method, bits) for every method and bit width."""
    return [(m, None) for m in FLOAT_METHODS] + [(m, b) for m in QUANT_METHODS for b in BITS]


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()) ** 2).sum().item() / (x.double() ** 2).sum().item()


def random_rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed scales and a few outliers, so that clipping matters.
    rows = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g)
    rows += (torch.rand(n, d, generator=g) < 0.02) * torch.randn(n, d, generator=g) * 4
    return rows


@pytest.fixture(scope="module")
def trained_rows() -> torch.Tensor:
    """Rows of a small embedding table trained with Adagrad on a Zipf-skewed task, the same in every run (its
    initial weights too, which torch draws from the global RNG: seeded here, and the tests' RNG left as it was)."""
    g = torch.Generator().manual_seed(0)
    num, dim, pool = 3000, 32, 4
    with torch.random.fork_rng():
        torch.manual_seed(0)
        emb = torch.nn.EmbeddingBag(num, dim, mode="sum")
        torch.nn.init.uniform_(emb.weight, -(num**-0.5), num**-0.5)
        head = torch.nn.Linear(dim, 4)
    target_table = torch.randn(num, 4, generator=g)
    opt = torch.optim.Adagrad([*emb.parameters(), *head.parameters()], lr=0.05)
    probs = torch.arange(1, num + 1, dtype=torch.float32) ** -1.05
    seen = torch.zeros(num, dtype=torch.bool)
    for _ in range(80):
        ids = torch.multinomial(probs, 256 * pool, replacement=True, generator=g)
        seen[ids] = True
        target = target_table[ids].view(256, pool, 4).sum(1)
        loss = ((head(emb(ids, torch.arange(0, 256 * pool, pool))) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return emb.weight.detach()[seen][:1024].contiguous()


# ---- kernels against the references ------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", DIMS)
def test_pack_bits_matches_reference(bits, dim):
    codes = torch.randint(0, 1 << bits, (5, dim), dtype=torch.uint8)
    packed = ops.pack_bits(codes, bits)
    assert packed.shape == (5, ops.packed_bytes(dim, bits))
    assert torch.equal(packed, ref.pack_bits(codes, bits))
    assert torch.equal(ops.unpack_bits(packed, bits, dim), codes)


def test_pack_bits_three_bits_puts_eight_codes_in_three_bytes():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.uint8)
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes[0]))
    assert ops.pack_bits(codes, 3).tolist() == [[word & 255, (word >> 8) & 255, word >> 16]]


def test_pack_bits_rejects_codes_that_do_not_fit(backend):
    with pytest.raises(ValueError, match="below 2"):
        backend.pack_bits(torch.full((1, 4), 4, dtype=torch.uint8), 2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(
    "dtypes", [(torch.float16, torch.float32), (torch.float32, torch.float32), (torch.float16, torch.float16)]
)
def test_quantize_uniform_is_bit_exact_with_reference(bits, symmetric, dtypes):
    rows = random_rows(300, 33, seed=bits)
    payload, scale, bias, status = ops.quantize_uniform(
        rows, bits, symmetric=symmetric, scale_dtype=dtypes[0], bias_dtype=dtypes[1]
    )
    codes, r_scale, r_bias = ref.quantize_uniform(rows, bits, symmetric, *dtypes)
    assert not status.any()
    assert torch.equal(payload, ref.pack_bits(codes, bits))
    assert scale.dtype == dtypes[0] and torch.equal(scale.float(), r_scale)
    if symmetric:
        assert bias.numel() == 0
    else:
        assert bias.dtype == dtypes[1] and torch.equal(bias.float(), r_bias)
    decoded = ops.dequantize_uniform(payload, scale, None if symmetric else bias, bits, 33)
    assert torch.equal(decoded, ref.dequantize_uniform(codes, r_scale, r_bias, bits))


@pytest.mark.parametrize("method", ["uniform_sym", "uniform_asym", "adaptive"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", DIMS)
def test_uniform_error_is_at_most_half_a_step_inside_the_range(method, bits, dim):
    rows = random_rows(64, dim, seed=dim)
    enc = get_codec(method, bits).encode(rows)
    err = (decode(enc) - rows).abs()
    scale = enc.scale.float()[:, None]
    if enc.bias is None:
        qmax = (1 << (bits - 1)) - 1
        lo, hi = -qmax * scale, qmax * scale
    else:
        lo = enc.bias.float()[:, None]
        hi = lo + ((1 << bits) - 1) * scale
    inside = (rows >= lo) & (rows <= hi)
    if method != "adaptive":
        assert inside.all(), "min/max grids must cover every value"
    slack = 1e-6 * rows.abs().amax(dim=1, keepdim=True)  # float rounding of x - bias
    assert (err <= scale / 2 + slack)[inside].all()


@pytest.mark.parametrize("bits", BITS)
def test_adaptive_search_matches_reference(trained_rows, bits):
    lo, scale = ops.adaptive_search(trained_rows, bits, 25, 0.6, 4)
    r_lo, r_scale = ref.adaptive_search(trained_rows, bits, 25, 0.6, 4)
    err = ref.grid_error(trained_rows, lo, scale, bits).sum()
    r_err = ref.grid_error(trained_rows, r_lo, r_scale, bits).sum()
    assert err <= r_err * 1.001
    # Sums in another order can flip a near-tie and the greedy path with it.
    same = (lo - r_lo).abs() <= 1e-5 * trained_rows.abs().amax(dim=1)
    assert same.float().mean() >= 0.98


def test_exhaustive_search_matches_reference(trained_rows):
    rows = trained_rows[:16]
    lo, scale = ops.exhaustive_search(rows, 3, 24)
    r_lo, r_scale = ref.exhaustive_search(rows, 3, 24)
    err = ref.grid_error(rows, lo, scale, 3)
    r_err = ref.grid_error(rows, r_lo, r_scale, 3)
    torch.testing.assert_close(err, r_err, rtol=1e-4, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_adaptive_default_is_within_two_percent_of_exhaustive(trained_rows, bits):
    codec = get_codec("adaptive", bits)
    p = codec.params
    lo, scale = ops.adaptive_search(trained_rows, bits, p["num_bins"], p["ratio"], p["refit_iters"])
    ex_lo, ex_scale = ops.exhaustive_search(trained_rows[:256], bits, 100)
    adaptive = ref.grid_error(trained_rows[:256], lo[:256], scale[:256], bits).sum()
    exhaustive = ref.grid_error(trained_rows[:256], ex_lo, ex_scale, bits).sum()
    assert adaptive <= exhaustive * 1.02


def test_fused_adaptive_quantize_gives_the_same_bytes_as_search_then_quantize(trained_rows):
    for bits in BITS:
        for dtypes in [(torch.float16, torch.float32), (torch.float32, torch.float16)]:
            fused = ops.adaptive_quantize(trained_rows, bits, 25, 0.6, 4, scale_dtype=dtypes[0], bias_dtype=dtypes[1])
            lo, scale = ops.adaptive_search(trained_rows, bits, 25, 0.6, 4)
            two = ops.quantize_uniform(
                trained_rows,
                bits,
                symmetric=False,
                scale_dtype=dtypes[0],
                bias_dtype=dtypes[1],
                grid_bias=lo,
                grid_scale=scale,
            )
            for a, b in zip(fused, two):
                assert torch.equal(a, b)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [7, 33, 128])
@pytest.mark.parametrize("init", ["minmax", "grid"])
def test_kmeans_matches_reference(bits, dim, init):
    rows = random_rows(128, dim, seed=bits)
    grid = ops.adaptive_search(rows, bits, 25, 0.6, 4) if init == "grid" else (None, None)
    payload, bias, codebook, status = ops.kmeans_quantize(rows, bits, 10, torch.float16, *grid)
    codes, centroids = ref.kmeans(rows, bits, 10, torch.float16, *grid)
    assert not status.any()
    assert codebook.shape == (128, min(1 << bits, dim) - 1)
    decoded = ops.dequantize_codebook(payload, bias, codebook, bits, dim)
    r_decoded = centroids.gather(1, codes.long())
    assert (ops.unpack_bits(payload, bits, dim) == codes).float().mean() >= 0.999
    assert rel_mse(rows, decoded) <= rel_mse(rows, r_decoded) * 1.001 + 1e-9


def test_kmeans_rows_no_longer_than_the_codebook_are_exact_up_to_float16():
    rows = random_rows(50, 16)
    enc = get_codec("kmeans", 4).encode(rows)
    assert enc.codebook.shape == (50, 15)
    torch.testing.assert_close(decode(enc), rows, rtol=0, atol=1e-3 * rows.abs().max().item())


def test_dequantize_codebook_rejects_codes_beyond_the_codebook(backend):
    payload = backend.pack_bits(torch.tensor([[0, 3, 1]], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="corrupt"):
        backend.dequantize_codebook(payload, torch.zeros(1), torch.zeros(1, 2), 2, 3)


# ---- round trips and the storage format ----------------------------------------


@pytest.mark.parametrize("method,bits", all_codecs())
@pytest.mark.parametrize("dim", DIMS)
def test_round_trip_through_plain_tensors_and_json(method, bits, dim):
    codec = get_codec(method, bits)
    rows = random_rows(40, dim, seed=dim)
    enc = codec.encode(rows)
    tensors = {k: v.clone() for k, v in enc.to_tensors().items()}
    meta = json.loads(json.dumps(enc.metadata()))
    back = rebuild(tensors, meta)
    out = decode(back)
    assert out.dtype == torch.float32 and out.shape == rows.shape
    assert torch.equal(out, codec.decode(enc))
    assert enc.nbytes == back.nbytes == codec.bytes_per_row(dim) * 40
    assert all(t.dtype in (torch.uint8, torch.float16, torch.float32) for t in tensors.values())
    # Loose per-width bounds: every codec must be far better than nothing.
    bound = {None: 1e-4, 2: 0.9, 3: 0.3, 4: 0.08, 8: 3e-4}[bits]
    assert rel_mse(rows, out) <= bound


def _scattered(method, bits, out_dtype, seed):
    """300 encoded rows of 33 values, each sent to a distinct row of a [1000, 50] block (40% skipped, -1), whose
    columns 10:43 receive them. Returns (codec, encoded, rows, kept, block)."""
    codec = get_codec(method, bits)
    enc = codec.encode(random_rows(300, 33, seed=bits or 1))
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(1000, generator=gen)[:300]
    rows[torch.rand(300, generator=gen) < 0.4] = -1  # skipped
    base = torch.randn(1000, 50, generator=gen).to(out_dtype)
    return codec, enc, rows, rows >= 0, base


@pytest.mark.parametrize("method,bits", all_codecs())
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_decode_into_writes_the_decoded_rows_where_rows_says(method, bits, out_dtype):
    codec, enc, rows, keep, base = _scattered(method, bits, out_dtype, seed=5)
    expected = base.clone()
    expected[rows[keep], 10:43] = codec.decode(enc)[keep].to(out_dtype)
    out = base.clone()
    codec.decode_into(enc, out[:, 10:43], rows)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("method,bits", all_codecs())
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_decode_into_with_accumulate_adds_the_decoded_rows(method, bits, out_dtype):
    # A residual chain's restore: each kept row's decoded value added onto its destination, rounded once, as
    # torch's own addition of the decoded rows gives it; other rows and columns untouched.
    codec, enc, rows, keep, base = _scattered(method, bits, out_dtype, seed=6)
    expected = base.clone()
    expected[rows[keep], 10:43] = base[rows[keep], 10:43] + codec.decode(enc)[keep].to(out_dtype)
    out = base.clone()
    codec.decode_into(enc, out[:, 10:43], rows, accumulate=True)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("method,bits", [("adaptive", 4), ("uniform_sym", 8), ("kmeans", 3)])
def test_decode_into_with_accumulate_refuses_a_destination_twice(method, bits):
    codec = get_codec(method, bits)
    enc = codec.encode(random_rows(10, 8))
    out = torch.zeros(20, 8)
    rows = torch.arange(10)
    rows[7] = 2  # two rows would add onto row 2 at once
    with pytest.raises(ValueError, match="distinct destination rows"):
        codec.decode_into(enc, out, rows, accumulate=True)
    assert not out.any()  # refused before anything was added
    rows[7] = -1  # a skipped row is no destination
    codec.decode_into(enc, out, rows, accumulate=True)
    assert torch.equal(out[2], codec.decode(enc)[2])


@pytest.mark.parametrize("method", ["uniform_asym", "uniform_sym", "adaptive"])
def test_decode_into_sends_the_encoded_rows_to_the_destination_device(method, monkeypatch):
    """A restore onto a CUDA table ships its 2-8-bit codes to the device and decodes there (the kernel's CUDA
    twin is checked against the CPU one under the emulation, tests/test_cuda_emulation.py). Here the destination
    is on the meta device, which this CPU-only machine has: every argument the kernel gets must be there."""
    from cnr_torchrec.quant import ops

    seen = []
    monkeypatch.setattr(ops, "dequantize_uniform_into_", lambda *args: seen.append(
        [a.device.type for a in args if isinstance(a, torch.Tensor)]))
    codec = get_codec(method, 4)
    out = torch.empty(20, 8, device="meta")
    codec.decode_into(codec.encode(random_rows(10, 8)), out, torch.arange(10), accumulate=True)
    assert seen and all(d == "meta" for d in seen[0]), seen


@pytest.mark.parametrize("method,bits", all_codecs())
def test_view_decoded_is_the_stored_float32_rows_themselves_and_nothing_for_other_codecs(method, bits):
    codec = get_codec(method, bits)
    rows = random_rows(12, 7)
    enc = codec.encode(rows)
    view = codec.view_decoded(enc)
    if method != "none":
        assert view is None
        return
    assert view is not None and torch.equal(view, rows) and torch.equal(view, codec.decode(enc))
    assert view.data_ptr() == enc.payload.data_ptr()  # no copy: the payload's own bytes
    assert codec.decode(enc).data_ptr() != enc.payload.data_ptr()  # decode still gives rows of their own


def test_decode_into_rejects_what_does_not_fit():
    codec = get_codec("adaptive", 4)
    enc = codec.encode(random_rows(10, 8))
    out = torch.zeros(20, 8)
    with pytest.raises(IndexError):
        codec.decode_into(enc, out, torch.arange(10) + 15)
    for other in (get_codec("kmeans", 4), get_codec("none")):  # the decoded-then-copied path, and float32's own
        with pytest.raises(IndexError):
            other.decode_into(other.encode(random_rows(10, 8)), out, torch.arange(10) + 15)
    assert not out.any()  # nothing written
    with pytest.raises(ValueError, match="one per encoded row"):
        codec.decode_into(enc, out, torch.arange(9))
    with pytest.raises(ValueError, match=r"\[M, 8\] with contiguous columns"):
        codec.decode_into(enc, torch.zeros(20, 9), torch.arange(10))
    with pytest.raises(ValueError, match="contiguous columns"):
        codec.decode_into(enc, torch.zeros(8, 20).t(), torch.arange(10))


def test_codecs_give_the_widths_they_promise():
    rows = random_rows(10, 64)
    sizes = {m: get_codec(m, None if m in FLOAT_METHODS else 4).encode(rows).nbytes // 10 for m in METHODS}
    assert sizes == {
        "none": 256,
        "fp16": 128,
        "bf16": 128,
        "uniform_sym": 32 + 4,
        "uniform_asym": 32 + 2 + 4,
        "kmeans": 32 + 4 + 15 * 2,
        "adaptive": 32 + 2 + 4,
    }


def test_rebuild_rejects_inconsistent_data():
    enc = get_codec("adaptive", 3).encode(random_rows(8, 10))
    meta = enc.metadata()
    with pytest.raises(EncodingFormatError, match="version"):
        rebuild(enc.to_tensors(), {**meta, "version": 99})
    with pytest.raises(EncodingFormatError, match="payload"):
        rebuild({**enc.to_tensors(), "payload": enc.payload[:, :-1]}, meta)
    with pytest.raises(EncodingFormatError, match="one entry per row"):
        rebuild({**enc.to_tensors(), "scale": enc.scale[:-1]}, meta)
    with pytest.raises(EncodingFormatError, match="no valid codec"):
        rebuild(enc.to_tensors(), {**meta, "method": "zstd"})
    # The structure alone passes a payload one byte short a row; only the codec's layout refuses it.
    assert EncodedRows.from_tensors({**enc.to_tensors(), "payload": enc.payload[:, :-1]}, meta).num_rows == 8
    with pytest.raises(EncodingFormatError, match="cannot be decoded"):
        get_codec("uniform_asym", 3).decode(enc)


# ---- accuracy on a trained table ------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_trained_rows_order_adaptive_asym_sym(trained_rows, bits):
    err = {m: rel_mse(trained_rows, decode(get_codec(m, bits).encode(trained_rows))) for m in QUANT_METHODS}
    assert err["adaptive"] <= err["uniform_asym"] <= err["uniform_sym"]
    assert err["kmeans"] <= err["adaptive"]


# ---- determinism -------------------------------------------------------------------


def _encode_all(rows: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    return {f"{m}_{b}": get_codec(m, b).encode(rows).to_tensors() for m, b in all_codecs()}


def test_same_bytes_whatever_the_thread_count(trained_rows):
    rows = torch.cat([trained_rows, random_rows(333, 32)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _encode_all(rows)
        torch.set_num_threads(2)
        two = _encode_all(rows)
    finally:
        torch.set_num_threads(before)
    for key in one:
        for name in one[key]:
            assert torch.equal(one[key][name], two[key][name]), (key, name)


_DIGEST = """
import hashlib, torch
from cnr_torchrec.quant import get_codec
from cnr_torchrec.quant.registry import METHODS
g = torch.Generator().manual_seed(1)
rows = torch.randn(77, 45, generator=g) * torch.rand(77, 1, generator=g)
h = hashlib.sha256()
for m in METHODS:
    for b in ([None] if m in ("none", "fp16", "bf16") else [2, 3, 4, 8]):
        for t in get_codec(m, b).encode(rows).to_tensors().values():
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


def test_same_bytes_whatever_the_vector_width():
    """The blocked kernels run at the CPU's widest vectors; capping them must not change a byte."""

    def digest(lanes: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "CNR_CODEC_LANES"}
        if lanes:
            env["CNR_CODEC_LANES"] = lanes
        out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    widest = digest(None)
    assert digest("4") == widest
    assert digest("8") == widest


# ---- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("method,bits", all_codecs())
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rows_raise_with_their_count(method, bits, bad):
    rows = random_rows(20, 16)
    rows[3, 5] = bad
    rows[11, 0] = bad
    with pytest.raises(NonFiniteRowsError) as info:
        get_codec(method, bits).encode(rows)
    assert isinstance(info.value, ValueError)
    assert info.value.num_rows == 2 and info.value.row_indices == [3, 11]
    assert "2 row(s)" in str(info.value)


def test_fbgemm_path_also_catches_nan():
    codec = get_codec("uniform_asym", 4, scale_dtype="float16", bias_dtype="float16", backend="fbgemm")
    rows = random_rows(20, 16)
    rows[7, 2] = math.nan
    with pytest.raises(NonFiniteRowsError, match="1 row"):
        codec.encode(rows)


def test_unknown_method_bits_or_param_list_the_choices():
    with pytest.raises(UnknownCodecError, match="valid methods: none, fp16, bf16, uniform_sym"):
        get_codec("zstd", 4)
    with pytest.raises(UnknownCodecError, match="valid bits: 2, 3, 4, 8"):
        get_codec("adaptive", 5)
    with pytest.raises(UnknownCodecError, match="valid bits: 2, 3, 4, 8"):
        get_codec("kmeans")
    with pytest.raises(UnknownCodecError, match="valid bits: 16"):
        get_codec("fp16", 8)
    with pytest.raises(UnknownCodecError, match="its parameters: bias_dtype, num_bins, ratio"):
        get_codec("adaptive", 4, bins=10)
    with pytest.raises(UnknownCodecError, match=r"ratio=1.5 is invalid; expected a number in \(0, 1\]"):
        get_codec("adaptive", 4, ratio=1.5)
    with pytest.raises(UnknownCodecError, match="backend='fbgemm' needs"):
        get_codec("uniform_asym", 3, backend="fbgemm")
    assert isinstance(UnknownCodecError("x"), ValueError)


@pytest.mark.parametrize("method,bits", all_codecs())
def test_empty_input(method, bits):
    codec = get_codec(method, bits)
    enc = codec.encode(torch.empty(0, 12))
    assert enc.num_rows == 0 and enc.nbytes == 0
    assert decode(rebuild(enc.to_tensors(), enc.metadata())).shape == (0, 12)


@pytest.mark.parametrize("method,bits", all_codecs())
def test_constant_rows_round_trip_exactly(method, bits):
    values = [0.0, 1.0, -2.5, 0.1, -3.14159, 1234.5678, 1e-30, -7e5]
    if method == "fp16":
        values = [v for v in values if abs(v) < 65504]
    if method in ("fp16", "bf16"):  # exact only where the format can hold the value at all
        dtype = torch.float16 if method == "fp16" else torch.bfloat16
        values = [v for v in values if torch.tensor(v).to(dtype).float().item() == torch.tensor(v).item()]
    rows = torch.tensor(values, dtype=torch.float32)[:, None].expand(-1, 9).contiguous()
    assert torch.equal(decode(get_codec(method, bits).encode(rows)), rows)


def test_non_float32_and_wrong_rank_inputs_are_rejected_clearly():
    codec = get_codec("adaptive", 4)
    with pytest.raises(InvalidRowsError, match="float32, got torch.float64") as info:
        codec.encode(torch.zeros(3, 4, dtype=torch.float64))
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    with pytest.raises(InvalidRowsError, match=r"2-D \[N, D\]"):
        codec.encode(torch.zeros(4))
    with pytest.raises(InvalidRowsError, match=r"2-D \[N, D\]"):
        codec.encode(torch.zeros(2, 3, 4))
    with pytest.raises(InvalidRowsError, match="D >= 1"):
        codec.encode(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="float32"):
        half_rows = torch.zeros(2, 2, dtype=torch.half)
        ops.quantize_uniform(half_rows, 4, symmetric=False, scale_dtype=torch.half, bias_dtype=torch.float)


def test_fp16_overflow_raises_and_wide_rows_promote_parameters():
    rows = random_rows(6, 8)
    rows[4] *= 1e6
    with pytest.raises(RowOverflowError, match=r"row indices \[4\]"):
        get_codec("fp16").encode(rows)
    enc = get_codec("uniform_asym", 4, bias_dtype="float16").encode(rows)
    assert enc.params["scale_dtype"] == enc.params["bias_dtype"] == "float32"
    assert enc.scale.dtype == enc.bias.dtype == torch.float32
    assert rel_mse(rows, decode(enc)) < 0.01


def test_decoded_rows_never_alias_the_payload():
    enc = get_codec("none").encode(random_rows(4, 8))
    out = decode(enc)
    out.zero_()
    assert decode(enc).abs().sum() > 0


def test_non_contiguous_and_grad_inputs_are_fine():
    base = random_rows(10, 20).requires_grad_()
    view = base[:, ::2]
    enc = get_codec("kmeans", 3).encode(view)
    assert decode(enc).shape == (10, 10)


# ---- FBGEMM's rowwise ops -----------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fbgemm_layout_matches_ours(bits):
    rows = random_rows(50, 64)
    fb = get_codec("uniform_asym", bits, scale_dtype="float16", bias_dtype="float16", backend="fbgemm")
    ours = get_codec("uniform_asym", bits, scale_dtype="float16", bias_dtype="float16")
    enc = fb.encode(rows)
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(rows, bits)
    params = [enc.scale.view(torch.uint8).view(50, 2), enc.bias.view(torch.uint8).view(50, 2)]
    assert torch.equal(torch.cat([enc.payload, *params], 1), fused)
    # One layout, one decoder: FBGEMM's inverse op and ours agree bit for bit.
    assert torch.equal(decode(enc), torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, bits))
    assert rel_mse(rows, decode(ours.encode(rows))) <= rel_mse(rows, decode(enc)) * 1.05


def test_fbgemm_8bit_float32_layout():
    rows = random_rows(50, 24)
    enc = get_codec("uniform_asym", 8, scale_dtype="float32", bias_dtype="float32", backend="fbgemm").encode(rows)
    fused = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(rows)
    assert torch.equal(enc.payload, fused[:, :24])
    torch.testing.assert_close(decode(enc), torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(fused), rtol=0, atol=1e-6)


# ---- torch.library.opcheck -------------------------------------------------------------


def _op_samples():
    rows = random_rows(37, 13)
    codes = torch.randint(0, 8, (5, 11), dtype=torch.uint8)
    payload, scale, bias, _ = ops.quantize_uniform(
        rows, 3, symmetric=False, scale_dtype=torch.half, bias_dtype=torch.float
    )
    km = ops.kmeans_quantize(rows, 2, 3, torch.half)
    lo, s = ops.adaptive_search(rows, 3, 10, 0.5, 1)
    lo2, s2 = ops.adaptive_search(rows, 2, 10, 0.5, 1)
    return [
        ("pack_bits", (codes, 3)),
        ("unpack_bits", (ops.pack_bits(codes, 3), 3, 11)),
        ("cast_rows", (rows, torch.bfloat16)),
        ("quantize_uniform", (rows, 3, False, torch.half, torch.float, None, None)),
        ("quantize_uniform", (rows, 4, True, torch.float, torch.float, None, None)),
        ("quantize_uniform", (rows, 3, False, torch.half, torch.float, lo, s)),
        ("dequantize_uniform", (payload, scale, bias, 3, 13)),
        ("dequantize_uniform_into_", (payload, scale, bias, 3, torch.arange(37) * 2 - 5, torch.zeros(80, 13))),
        ("dequantize_uniform_into_", (payload, scale, bias, 3, torch.arange(37) * 2 - 5, torch.zeros(80, 13), True)),
        ("adaptive_search", (rows, 3, 10, 0.5, 1)),
        ("adaptive_quantize", (rows, 3, 10, 0.5, 1, torch.half, torch.float)),
        ("exhaustive_search", (rows, 2, 6)),
        ("kmeans_quantize", (rows, 2, 3, torch.half, None, None)),
        ("kmeans_quantize", (rows, 2, 3, torch.float, lo2, s2)),
        ("dequantize_codebook", (km[0], km[1], km[2], 2, 13)),
    ]


@pytest.mark.parametrize("name,args", _op_samples(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.cnr, name).default, args)
