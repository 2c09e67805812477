"""``torch.ops.cnr.row_crc32c`` against the google-crc32c package (also run on the portable build, whose
CRC is a table rather than SSE4.2's instruction: scripts/install_check.sh)."""

from __future__ import annotations

import google_crc32c
import pytest
import torch

from cnr_torchrec import ops


def _reference(parts: list[torch.Tensor]) -> list[int]:
    return [google_crc32c.value(b"".join(bytes(p[i].contiguous().numpy()) for p in parts))
            for i in range(parts[0].shape[0])]


@pytest.mark.parametrize("widths", [[16], [16, 2, 2, 2, 4], [1], [0, 5], [33, 7], [130]])
def test_row_crc32c_is_crc32c_of_each_row(widths):
    gen = torch.Generator().manual_seed(sum(widths))
    parts = [torch.randint(0, 256, (257, w), dtype=torch.uint8, generator=gen) for w in widths]
    got = ops.row_crc32c(parts)
    assert got.dtype == torch.int32 and got.shape == (257,)
    assert [v & 0xFFFFFFFF for v in got.tolist()] == _reference(parts)


@pytest.mark.parametrize("group", [2, 23, 256, 300])  # part after part over each group's rows
def test_row_crc32c_of_groups_covers_their_rows_in_order(group):
    gen = torch.Generator().manual_seed(group)
    parts = [torch.randint(0, 256, (257, w), dtype=torch.uint8, generator=gen) for w in (16, 2, 4)]
    got = ops.row_crc32c(parts, group)
    want = [google_crc32c.value(b"".join(bytes(p[g : g + group].numpy()) for p in parts)) for g in range(0, 257, group)]
    assert [v & 0xFFFFFFFF for v in got.tolist()] == want  # the last group holds what is left
    picked = torch.tensor([got.numel() - 1, 0, got.numel() - 1])  # any groups, in any order
    assert torch.equal(ops.row_crc32c(parts, group, picked), got[picked])
    shuffled = torch.randperm(got.numel(), generator=gen)  # whole groups side by side, the short one among them
    assert torch.equal(ops.row_crc32c(parts, group, shuffled), got[shuffled])
    strided = [torch.cat([p, p], dim=1)[:, : p.shape[1]] for p in parts]  # rows apart: hashed row by row
    assert torch.equal(ops.row_crc32c(strided, group), got)


def test_row_crc32c_reads_column_slices_and_no_rows():
    base = torch.randint(0, 256, (50, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    part = base[:, 3:17]  # rows 24 bytes apart
    assert [v & 0xFFFFFFFF for v in ops.row_crc32c([part]).tolist()] == _reference([part])
    assert ops.row_crc32c([torch.empty(0, 8, dtype=torch.uint8)]).shape == (0,)


@pytest.mark.parametrize("bad", ["float", "1-D", "rows", "group"])
def test_row_crc32c_refuses_what_is_not_rows_of_bytes(bad):
    ok = torch.zeros(4, 3, dtype=torch.uint8)
    parts = {"float": [ok.float()], "1-D": [ok.reshape(-1)], "rows": [ok, torch.zeros(5, 3, dtype=torch.uint8)],
             "group": [ok]}[bad]
    with pytest.raises(ValueError, match="row_crc32c"):
        ops.row_crc32c(parts, 0 if bad == "group" else 1)
