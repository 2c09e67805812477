"""Row ids and RNG state as stored (format/row_ids.py, live/rng.py): the id encodings at their boundaries, the
bitmap's bit order, and the RNG states round-tripped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from _format_checks import round_trip

from cnr_torchrec.ckpt.format.row_ids import decode_ids, encode_ids
from cnr_torchrec.ckpt.live.rng import rng_state, set_rng_state


@pytest.mark.parametrize("num_rows,count", [(0, 0), (1, 0), (1, 1), (31, 1), (32, 1), (33, 1), (64, 2), (65, 2),
                                            (100, 3), (100, 4), (1000, 31), (1000, 32), (1000, 1000),
                                            (4096, 128), (4097, 128), (10**5, 7)])
def test_row_id_encoding(num_rows, count):
    """Both kinds round-trip; the one chosen is never bigger than the other."""
    g = torch.Generator().manual_seed(num_rows * 7 + count)
    ids = torch.randperm(num_rows, generator=g)[:count].sort().values
    kind, blob = encode_ids(ids, num_rows)
    bitmap_bytes, list_bytes = (num_rows + 7) // 8, 4 * count
    assert kind == ("bitmap" if bitmap_bytes <= list_bytes else "list")
    assert blob.numel() * blob.element_size() == min(bitmap_bytes, list_bytes)
    assert blob.dtype == (torch.uint8 if kind == "bitmap" else torch.int32)
    back = decode_ids(kind, blob, num_rows)
    assert back.dtype == torch.int64 and torch.equal(back, ids)
    # The other kind, built by hand, decodes to the same ids.
    mask = torch.zeros(num_rows, dtype=torch.bool)
    mask[ids] = True
    bits = torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    assert torch.equal(decode_ids("bitmap", bits, num_rows), ids)
    assert torch.equal(decode_ids("list", ids.to(torch.int32), num_rows), ids)


def test_bitmap_bit_order():
    """Row r is bit r % 8 of byte r // 8."""
    kind, blob = encode_ids(torch.tensor([0, 9, 15]), 16)
    assert kind == "bitmap" and blob.tolist() == [0b00000001, 0b10000010]


def test_unknown_id_encoding():
    with pytest.raises(ValueError, match="'rle'"):
        decode_ids("rle", torch.zeros(1, dtype=torch.uint8), 8)


def _draws():
    return (torch.rand(5).tolist(), torch.randint(0, 1000, (3,)).tolist(), random.random(), random.gauss(0, 1),
            np.random.rand(3).tolist(), np.random.randn(1).tolist())


@pytest.mark.parametrize("through_storage", [False, True])
def test_rng_state_round_trip(storage, through_storage):
    """Draw, save, draw, restore, draw again: the two draws after the save agree in every stream."""
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    _draws()  # leaves a cached gaussian in python's and numpy's generators
    state = rng_state()
    if through_storage:
        state = round_trip(storage, state)
    first = _draws()
    _draws()
    set_rng_state(state)
    assert _draws() == first
