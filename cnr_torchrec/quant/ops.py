"""Typed wrappers of the ``torch.ops.cnr`` row-codec ops.

Rows are float32 ``[N, D]``. Codes of ``bits`` in {2, 3, 4, 8} are packed per row as
an LSB-first bit stream padded to a byte, ``ceil(D * bits / 8)`` bytes per row:
eight codes make exactly ``bits`` bytes, and for 2, 4 and 8 bits the layout is
FBGEMM's. Encoders return a uint8 ``status`` per row (``STATUS_NON_FINITE``,
``STATUS_OVERFLOW``) instead of raising, so that a caller can name the bad rows.
The pure-torch references the tests compare against live in ``_reference``.
"""

from __future__ import annotations

import torch

from cnr_torchrec._ext import ops as _ops

__all__ = [
    "STATUS_NON_FINITE",
    "STATUS_OVERFLOW",
    "packed_bytes",
    "pack_bits",
    "unpack_bits",
    "cast_rows",
    "quantize_uniform",
    "dequantize_uniform",
    "dequantize_uniform_into_",
    "adaptive_search",
    "adaptive_quantize",
    "exhaustive_search",
    "kmeans_quantize",
    "dequantize_codebook",
]

STATUS_NON_FINITE = 1
"""Status bit: the row holds a NaN or an Inf."""
STATUS_OVERFLOW = 2
"""Status bit: a value or per-row parameter does not fit its storage dtype."""


def packed_bytes(dim: int, bits: int) -> int:
    """Bytes of one packed row of ``dim`` codes of ``bits`` bits."""
    return (dim * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs uint8 codes ``[N, D]`` (each below ``2**bits``) into ``[N, ceil(D * bits / 8)]`` bytes.

    Raises:
        ValueError: ``bits`` is not 2, 3, 4 or 8, or a code does not fit in ``bits``.
    """
    return _ops.pack_bits(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 codes ``[N, dim]``.

    Raises:
        ValueError: ``packed`` does not have ``packed_bytes(dim, bits)`` bytes per row.
    """
    return _ops.unpack_bits(packed, bits, dim)


def cast_rows(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as bytes of ``dtype`` (float32, float16 or bfloat16).

    Returns:
        ``(payload uint8 [N, D * itemsize], status uint8 [N])``; ``STATUS_OVERFLOW``
        marks finite values that round to Inf in ``dtype``.
    """
    return _ops.cast_rows(rows, dtype)


def quantize_uniform(
    rows: torch.Tensor,
    bits: int,
    *,
    symmetric: bool,
    scale_dtype: torch.dtype,
    bias_dtype: torch.dtype,
    grid_bias: torch.Tensor | None = None,
    grid_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform rowwise quantization.

    Asymmetric: ``x ~ bias + scale * q``, q in [0, 2**bits - 1], on [min, max] or on the
    given grid (e.g. from :func:`adaptive_search`). Symmetric: ``x ~ scale * (q - qmax)``
    with ``qmax = 2**(bits - 1) - 1``. The stored scale is rounded up and the bias down
    to their dtype (float16 or float32) and the codes are computed against the stored
    values, so every value inside the stored range is within ``scale / 2``.

    Returns:
        ``(payload [N, packed_bytes], scale [N], bias [N] (empty when symmetric), status [N])``.
    """
    return _ops.quantize_uniform(rows, bits, symmetric, scale_dtype, bias_dtype, grid_bias, grid_scale)


def dequantize_uniform(
    payload: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, bits: int, dim: int
) -> torch.Tensor:
    """Float32 rows ``[N, dim]`` from :func:`quantize_uniform`'s output (``bias=None``: symmetric)."""
    return _ops.dequantize_uniform(payload, scale, bias, bits, dim)


def dequantize_uniform_into_(
    payload: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, bits: int, rows: torch.Tensor,
    out: torch.Tensor, accumulate: bool = False,
) -> None:
    """Writes row ``r`` of :func:`dequantize_uniform`'s output to ``out[rows[r]]``; ``rows[r] < 0`` skips it.

    ``out`` is float32 ``[M, dim]`` with contiguous columns (a column slice of a weight
    works). Every index is checked before anything is written (IndexError). With
    ``accumulate`` the row is added onto ``out[rows[r]]`` instead, bit for bit
    ``out.index_add_(0, rows, dequantize_uniform(...))`` over the kept rows, and the kept
    destinations must be distinct (ValueError otherwise).
    """
    _ops.dequantize_uniform_into_(payload, scale, bias, bits, rows, out, accumulate)


def adaptive_search(
    rows: torch.Tensor, bits: int, num_bins: int, ratio: float, refit_iters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row asymmetric grid chosen by Check-N-Run's greedy range search plus refits.

    Starts at [min, max] with ``step = (max - min) / num_bins``; each round tries moving
    min up or max down by one step, keeps the move with the lower squared error and
    remembers the best range, until the range falls below ``ratio * (max - min)``. Then
    ``refit_iters`` least-squares refits of (bias, scale) to the codes of the best grid.

    Returns:
        ``(bias, scale)``, float32 ``[N]`` each; NaN for rows holding a NaN or an Inf.
    """
    return _ops.adaptive_search(rows, bits, num_bins, ratio, refit_iters)


def adaptive_quantize(
    rows: torch.Tensor,
    bits: int,
    num_bins: int,
    ratio: float,
    refit_iters: int,
    *,
    scale_dtype: torch.dtype,
    bias_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`adaptive_search` then :func:`quantize_uniform` on its grid, in one pass; the same bytes.

    Returns:
        ``(payload, scale, bias, status)`` as :func:`quantize_uniform` (asymmetric).
    """
    return _ops.adaptive_quantize(rows, bits, num_bins, ratio, refit_iters, scale_dtype, bias_dtype)


def exhaustive_search(rows: torch.Tensor, bits: int, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best asymmetric grid among all ranges on a ``grid``-step lattice of [min, max] (CPU only).

    Costs ``grid**2 / 2`` quantizations per row: a yardstick for :func:`adaptive_search`.
    """
    return _ops.exhaustive_search(rows, bits, grid)


def kmeans_quantize(
    rows: torch.Tensor,
    bits: int,
    iters: int,
    codebook_dtype: torch.dtype,
    grid_bias: torch.Tensor | None = None,
    grid_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row k-means with ``K = min(2**bits, D)`` centroids.

    Lloyd's algorithm runs ``iters`` iterations from the uniform grid
    ``grid_bias + grid_scale * k`` if given (e.g. from :func:`adaptive_search`), else
    from the one over [min, max]; it ends no worse than its start. Rows with
    ``D <= 2**bits`` take their own values as centroids.

    Returns:
        ``(payload, bias float32 [N] (smallest centroid), codebook [N, K - 1] (offsets of
        the others from it, in codebook_dtype), status [N])``.
    """
    return _ops.kmeans_quantize(rows, bits, iters, codebook_dtype, grid_bias, grid_scale)


def dequantize_codebook(
    payload: torch.Tensor, bias: torch.Tensor, codebook: torch.Tensor, bits: int, dim: int
) -> torch.Tensor:
    """Float32 rows ``[N, dim]`` from :func:`kmeans_quantize`'s output.

    Raises:
        ValueError: the payload holds a code beyond the codebook (corrupt data).
    """
    return _ops.dequantize_codebook(payload, bias, codebook, bits, dim)
