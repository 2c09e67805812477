"""How a save codes a shard's rows: whole, or in a residual chain each row whole or as a residual.

Rows are coded in blocks of about :data:`ENCODE_BLOCK_BYTES` of float32 input, so the codec's
temporaries stay a block's size whatever the shard's; the blocks' codes land in one tensor per
field (every codec's output is per row).

In a residual chain (``quantization.residual``) a delta codes each row it writes against ``r``,
what the chain restores for the row so far. Coded as a residual (``x - r``), the row restores as
``r + decode(encode(x - r))``, and the codec's grid spans the row's change; coded whole (``x``),
it restores as ``decode(encode(x))``, and the grid spans the row itself. A row that changed a lot
and is now small (a hot row shrinking under its optimizer) restores closer whole: on a residual's
grid its error can be many times the codec's bound relative to the row's own range. So each row
is coded both ways and kept in the mode whose restored row is closer to ``x``, by the measure the
codec's grid keeps small (:meth:`~cnr_torchrec.quant.Codec.row_error`: the largest absolute error
for a grid over [min, max], the sum of squared errors for the least-squares fits of ``adaptive``
and ``kmeans``; a tie keeps the residual), as a video codec picks intra or inter coding per block.
Either way no row restores worse, by that measure, than plain coding would restore it. The restore
reads which rows are whole from the entry's bitmap (:func:`~cnr_torchrec.ckpt.format.row_ids.stored_modes`).

A codec may widen its parameters for some rows (float32 scales for a row beyond float16's range);
an entry has one set, so when blocks or modes disagree every block is coded again with the wider.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from cnr_torchrec.quant import Codec, EncodedRows, codec_for

__all__ = ["ENCODE_BLOCK_BYTES", "ResidualRows", "code_residual", "encode_in_blocks"]

ENCODE_BLOCK_BYTES = 16 << 20  # fp32 input per codec call


@dataclasses.dataclass(frozen=True)
class ResidualRows:
    """A residual delta's rows, coded.

    Attributes:
        encoded: each row's codes, in its mode.
        whole: bool ``[rows]``, True where the row is coded whole (it closes the chain's older copies).
        restored: float32 ``[rows, cols]``, what the chain restores for each row once the delta commits.
    """

    encoded: EncodedRows
    whole: torch.Tensor
    restored: torch.Tensor


def encode_in_blocks(codec: Codec, rows: torch.Tensor, block_bytes: int = ENCODE_BLOCK_BYTES) -> EncodedRows:
    """``codec.encode(rows.float())``, a block of rows at a time.

    Raises:
        The codec's errors (NaN rows, say), for the first block that has them.
    """
    return _in_blocks(codec, rows.shape[0], rows.shape[1], block_bytes,
                      lambda c, lo, hi: c.encode(rows[lo:hi].float()))


def code_residual(codec: Codec, rows: torch.Tensor, reference: torch.Tensor,
                  block_bytes: int = ENCODE_BLOCK_BYTES) -> ResidualRows:
    """Codes each row of ``rows`` as a residual against the same row of ``reference`` (float32, what the chain
    restores) or whole, whichever restores closer (see the module's docstring).

    Raises:
        The codec's errors, for the first block that has them.
    """
    n, dim = rows.shape
    restored = torch.empty(n, dim, dtype=torch.float32)
    whole = torch.empty(n, dtype=torch.bool)

    def block(c: Codec, lo: int, hi: int) -> EncodedRows:
        encoded, whole[lo:hi] = _closer(c, rows[lo:hi].float(), reference[lo:hi], restored[lo:hi])
        return encoded

    encoded = _in_blocks(codec, n, dim, block_bytes, block)
    return ResidualRows(encoded, whole, restored)


def _closer(codec: Codec, x: torch.Tensor, r: torch.Tensor, restored: torch.Tensor) -> tuple[EncodedRows, torch.Tensor]:
    """One block: the codes and which rows are whole, each row in the mode that restores it closer to ``x``;
    what each row restores goes to ``restored``."""
    change = x - r
    as_residual, as_whole = codec.encode(change), codec.encode(x)
    if dict(as_residual.params) != dict(as_whole.params):  # one mode needed wider parameters: both take them
        codec = codec_for(as_residual if dict(as_residual.params) != codec.params else as_whole)
        as_residual, as_whole = codec.encode(change), codec.encode(x)
    torch.add(r, codec.decode(as_residual), out=restored)  # each row as a residual restores
    from_whole = codec.decode(as_whole)
    scratch = torch.sub(restored, x, out=change)
    err_residual = codec.row_error(scratch)
    whole = codec.row_error(torch.sub(from_whole, x, out=scratch)) < err_residual
    keep = whole.nonzero().squeeze(1)
    restored.index_copy_(0, keep, from_whole.index_select(0, keep))
    return _pick(whole, as_whole, as_residual), whole


def _pick(mask: torch.Tensor, a: EncodedRows, b: EncodedRows) -> EncodedRows:
    """Row ``i`` of ``a`` where ``mask[i]``, else of ``b`` (same codec, same parameters)."""
    if not bool(mask.any()):
        return b
    ta = a.to_tensors()
    return b.with_tensors({
        k: torch.where(mask.view(-1, *([1] * (v.dim() - 1))), ta[k], v) for k, v in b.to_tensors().items()})


def _in_blocks(codec: Codec, n: int, dim: int, block_bytes: int,
               code: Callable[[Codec, int, int], EncodedRows]) -> EncodedRows:
    """The codes of rows ``[0, n)``, ``code(codec, lo, hi)`` giving those of rows ``[lo, hi)``, gathered into
    one tensor per field. Should a block come back with parameters other than the first's, every block is
    coded again with the codec of the wider ones (:func:`~cnr_torchrec.quant.codec_for`)."""
    block = max(1, block_bytes // max(1, 4 * dim))
    first = code(codec, 0, min(n, block))
    if n <= block:
        return first
    out = {k: torch.empty((n, *v.shape[1:]), dtype=v.dtype) for k, v in first.to_tensors().items()}
    for lo in range(0, n, block):
        part = first if lo == 0 else code(codec, lo, min(n, lo + block))
        if dict(part.params) != dict(first.params):
            wider = part if dict(part.params) != codec.params else first
            return _in_blocks(codec_for(wider), n, dim, block_bytes, code)
        for k, v in part.to_tensors().items():
            out[k][lo : lo + v.shape[0]] = v
    return first.with_tensors(out)
