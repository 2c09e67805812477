"""An entry's stored rows as the format packs them: which rows it holds (row ids) and which of them whole (row modes).

The save side writes them and the restore side and the offline tools read them back,
so they live here rather than with either side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cnr_torchrec import ops
from cnr_torchrec.errors import CorruptCheckpointError

__all__ = ["decode_ids", "encode_ids", "encode_modes", "stored_modes", "stored_offsets"]


def encode_ids(ids: torch.Tensor, num_rows: int) -> tuple[str, torch.Tensor]:
    """Row offsets as a bitmap (1 bit per shard row) or a list (4 bytes per dirty row), whichever is smaller."""
    if num_rows <= 32 * ids.numel():
        mask = np.zeros(num_rows, dtype=bool)
        mask[ids.numpy()] = True
        return "bitmap", torch.from_numpy(np.packbits(mask, bitorder="little"))
    return "list", ids.to(torch.int32)


def decode_ids(kind: str, blob: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`encode_ids`: sorted int64 row offsets."""
    if kind == "bitmap":
        # LSB-first bytes are LSB-first int64 words on a little-endian host: the tracker's own bitmap layout.
        nbytes = (num_rows + 7) // 8
        words = torch.zeros(ops.bitmap_words(num_rows) * 8, dtype=torch.uint8)
        k = min(nbytes, blob.numel())  # a short blob decodes to fewer ids, which the caller's count check catches
        words[:k] = blob.reshape(-1)[:k]
        return ops.bitmap_to_rows(words.view(torch.int64), 0, num_rows)
    if kind == "list":
        return blob.to(torch.int64)
    raise ValueError(f"unknown id encoding {kind!r}")


def stored_offsets(entry: Any, blob: Callable[[str], torch.Tensor], where: str = "",
                   path: str = "") -> torch.Tensor | None:
    """The rows a :class:`~cnr_torchrec.ckpt.format.manifest.TableEntry` stores, as sorted offsets into its row
    range; None when it stores every row in order (no ids). ``blob``: reads a blob by name.

    Raises:
        CorruptCheckpointError: the ids do not decode to the entry's count of rows within its range;
            ``where`` (a file, a table) starts the message and ``path`` names the file.
    """
    ids = entry.ids
    if ids is None:
        return None
    try:
        offsets = decode_ids(ids.kind, blob(ids.blob), entry.num_rows)
    except (ValueError, RuntimeError) as e:
        raise CorruptCheckpointError(f"{where}row ids do not decode ({e}); run `cnr verify` on the checkpoint",
                                     path=path) from None
    last = int(offsets[-1]) if offsets.numel() else -1
    if offsets.numel() != ids.count or last >= entry.num_rows:
        raise CorruptCheckpointError(
            f"{where}row ids do not match the entry they describe: {offsets.numel()} ids up to offset {last}, for "
            f"{ids.count} stored rows of {entry.num_rows}; run `cnr verify` on the checkpoint", path=path)
    return offsets


def encode_modes(whole: torch.Tensor) -> torch.Tensor:
    """A residual entry's row modes (format 6): bit ``p`` (LSB first) of the uint8 bitmap is set when stored
    row ``p`` is stored whole rather than as a residual; the bits past the last row are 0."""
    return torch.from_numpy(np.packbits(whole.numpy(), bitorder="little"))


def stored_modes(entry: Any, blob: Callable[[str], torch.Tensor], where: str = "",
                 path: str = "") -> torch.Tensor | None:
    """Which stored rows of a residual :class:`~cnr_torchrec.ckpt.format.manifest.TableEntry` are stored whole: a
    bool ``[num_stored]``; None when the entry marks none (every row a residual, as before format 6).
    ``blob``: reads a blob by name.

    Raises:
        CorruptCheckpointError: the bitmap does not hold the entry's count of set bits, or sets a bit past
            its last row; ``where`` (a file, a table) starts the message and ``path`` names the file.
    """
    modes = entry.whole
    if modes is None:
        return None
    n = entry.num_stored
    packed = blob(modes.blob).reshape(-1)
    if packed.dtype != torch.uint8 or packed.numel() != (n + 7) // 8:
        raise CorruptCheckpointError(
            f"{where}the row-mode bitmap is {packed.numel()} values of {packed.dtype}, where {(n + 7) // 8} bytes "
            f"are needed for {n} stored rows; run `cnr verify` on the checkpoint", path=path)
    bits = np.unpackbits(packed.numpy(), bitorder="little")
    whole = torch.from_numpy(bits[:n].astype(bool))
    got = int(bits.sum())
    if got != modes.count or bits[n:].any():
        raise CorruptCheckpointError(
            f"{where}the row-mode bitmap sets {got} bits, {int(bits[n:].sum())} of them past the last of {n} "
            f"stored rows, where the entry says {modes.count} rows are stored whole; run `cnr verify` on the "
            "checkpoint", path=path)
    return whole
