"""How a save codes a shard's rows (cnr_torchrec.ckpt.save.coding), against the codecs' own encode and decode.

The reference for each row is written from the rule, with the public codec API: coded as a
residual a row restores as ``r + decode(encode(x - r))``, coded whole as ``decode(encode(x))``, and the
row is kept in the mode whose error against ``x`` is smaller (a tie keeps the residual), by the measure
the codec fits its grid to: the largest absolute error for uniform_asym's grid over [min, max], the
sum of squared errors for adaptive's least-squares search and k-means.
"""

from __future__ import annotations

import pytest
import torch

from cnr_torchrec.ckpt.save.coding import code_residual, encode_in_blocks
from cnr_torchrec.quant import decode, get_codec

CODECS = [("uniform_asym", 8), ("adaptive", 4), ("kmeans", 2)]


def _error(method, got, want):
    """Per row, the error by the measure ``method`` fits its grid to."""
    diff = got - want
    return diff.abs().amax(1) if method == "uniform_asym" else diff.square().sum(1)


def _rows(n=64, dim=16, seed=0):
    """``(x, r)``: half the rows changed a little since ``r``; the other half shrank from ``r`` to a tenth of it."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, dim, generator=g) * 0.1
    x = r + torch.randn(n, dim, generator=g) * 0.001
    x[n // 2 :] = r[n // 2 :] * 0.1 + torch.randn(n - n // 2, dim, generator=g) * 0.001
    return x, r


@pytest.mark.parametrize("method,bits", CODECS)
def test_each_row_is_kept_in_the_mode_that_restores_it_closer(method, bits):
    codec = get_codec(method, bits)
    x, r = _rows()
    coded = code_residual(codec, x, r)

    as_residual = r + codec.decode(codec.encode(x - r))
    as_whole = codec.decode(codec.encode(x))
    err_residual = _error(method, as_residual, x)
    err_whole = _error(method, as_whole, x)
    want_whole = err_whole < err_residual
    assert torch.equal(coded.whole, want_whole)
    assert bool(coded.whole[32:].any()) and not bool(coded.whole[:32].all())  # both modes occur
    torch.testing.assert_close(coded.restored, torch.where(want_whole.unsqueeze(1), as_whole, as_residual),
                               rtol=0, atol=0)
    # The codes decode to each row's stored value: the row itself where whole, its residual elsewhere.
    stored = decode(coded.encoded)
    torch.testing.assert_close(torch.where(coded.whole.unsqueeze(1), stored, r + stored), coded.restored,
                               rtol=0, atol=0)
    # No row restores farther from x than coding it whole does.
    assert bool((_error(method, coded.restored, x) <= err_whole).all())


@pytest.mark.parametrize("method,bits", CODECS)
def test_blocks_code_as_one_call_does(method, bits):
    codec = get_codec(method, bits)
    x, r = _rows(n=50)
    one = code_residual(codec, x, r)
    blocks = code_residual(codec, x, r, block_bytes=7 * 16 * 4)  # blocks of 7 rows, the last one short
    assert torch.equal(one.whole, blocks.whole) and torch.equal(one.restored, blocks.restored)
    assert one.encoded.to_tensors().keys() == blocks.encoded.to_tensors().keys()
    for k, v in one.encoded.to_tensors().items():
        assert torch.equal(v, blocks.encoded.to_tensors()[k]), k


def test_a_block_that_needs_wider_parameters_widens_every_block():
    """uniform_asym keeps float16 scales until a row's range exceeds them; one such row in a later block makes
    every block use float32 scales (an entry has one set of parameters), and every row decodes within a step."""
    codec = get_codec("uniform_asym", 8)
    x = torch.randn(20, 8) * 0.1
    x[15, 0] = 1e8  # a range of 1e8: its scale (range / 255) is beyond float16
    encoded = encode_in_blocks(codec, x, block_bytes=4 * 8 * 4)  # blocks of 4 rows
    assert encoded.params["scale_dtype"] == "float32"
    span = x.amax(1) - x.amin(1)
    assert bool(((decode(encoded) - x).abs().amax(1) <= span / 255 * 0.51).all())

    r = x.clone()
    r[:10] += 0.01  # residuals for the first rows; the wide row must widen the mode choice's blocks too
    coded = code_residual(codec, x, r, block_bytes=4 * 8 * 4)
    assert coded.encoded.params["scale_dtype"] == "float32"
    assert bool(((coded.restored - x).abs().amax(1) <= span / 255 * 0.51).all())
