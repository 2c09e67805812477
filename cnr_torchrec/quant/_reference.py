"""Pure-torch reference implementations of the row-codec kernels, for the tests.

They follow the specification, not the kernels' code: plain tensor ops over all rows
at once, bit packing through explicit bit tensors, and the searches and k-means in
float64. The uniform quantizer is bit-exact with the kernel (same float32 formulas);
the searches and k-means agree up to rounding in sums, which can flip near-ties.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "pack_bits",
    "unpack_bits",
    "round_param",
    "quantize_uniform",
    "dequantize_uniform",
    "grid_error",
    "adaptive_search",
    "exhaustive_search",
    "kmeans",
]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """LSB-first bit stream of each row of uint8 codes, padded to a byte."""
    n, d = codes.shape
    shifts = torch.arange(bits)
    stream = ((codes.long().unsqueeze(-1) >> shifts) & 1).reshape(n, d * bits)
    nb = (d * bits + 7) // 8
    stream = torch.nn.functional.pad(stream, (0, nb * 8 - d * bits))
    return (stream.reshape(n, nb, 8) << torch.arange(8)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`."""
    n = packed.shape[0]
    stream = ((packed.long().unsqueeze(-1) >> torch.arange(8)) & 1).reshape(n, -1)[:, : dim * bits]
    return (stream.reshape(n, dim, bits) << torch.arange(bits)).sum(-1).to(torch.uint8)


def round_param(v: torch.Tensor, dtype: torch.dtype, direction: int) -> torch.Tensor:
    """float32 values of ``v`` rounded to ``dtype``: to nearest (0), up (> 0) or down (< 0)."""
    if dtype == torch.float32:
        return v.clone()
    h = v.to(dtype)
    if direction > 0:
        h = torch.where(h.float() < v, torch.nextafter(h, torch.full_like(h, math.inf)), h)
    elif direction < 0:
        h = torch.where(h.float() > v, torch.nextafter(h, torch.full_like(h, -math.inf)), h)
    return h.float()


def _next_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.nextafter(s.to(dtype), torch.full_like(s.to(dtype), math.inf)).float()


def _covering_scale(span: torch.Tensor, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    s = round_param(span / qmax, dtype, +1)
    for _ in range(64):
        short = torch.isfinite(s) & (s * qmax < span)
        if not bool(short.any()):
            break
        s = torch.where(short, _next_up(s, dtype), s)
    return s


def quantize_uniform(
    rows: torch.Tensor,
    bits: int,
    symmetric: bool,
    scale_dtype: torch.dtype,
    bias_dtype: torch.dtype,
    grid_bias: torch.Tensor | None = None,
    grid_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes (uint8 ``[N, D]``, unpacked) and float32 values of the stored scale and bias.

    Asymmetric: bias = min rounded down, scale = the smallest stored step whose grid
    reaches max (or the given grid, bias rounded down and scale up). Symmetric:
    scale = max|x| / qmax rounded up, or max|x| itself when every |x| is 0 or max|x|.
    Codes: round-half-even of clamp((x - bias) / scale) with the stored values.
    """
    mn, mx = rows.min(dim=1).values, rows.max(dim=1).values
    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        amax = torch.maximum(-mn, mx)
        a = rows.abs()
        two = ((a == 0) | (a == amax[:, None])).all(dim=1)
        scale = torch.where(two, round_param(amax, scale_dtype, +1), _covering_scale(amax, qmax, scale_dtype))
        bias, lo, qmin = None, torch.zeros_like(scale), -qmax
    else:
        qmax, qmin = (1 << bits) - 1, 0
        if grid_bias is not None:
            assert grid_scale is not None  # a grid is given whole: its bias and scale
            lo = round_param(grid_bias, bias_dtype, -1)
            scale = round_param(grid_scale, scale_dtype, +1)
        else:
            lo = round_param(mn, bias_dtype, -1)
            scale = _covering_scale(mx - lo, qmax, scale_dtype)
        bias = lo
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.clamp((rows - lo[:, None]) * inv[:, None], qmin, qmax).round()
    return (q - qmin).to(torch.uint8), scale, bias


def dequantize_uniform(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """float32 rows from codes and float32 parameter values (``bias=None``: symmetric)."""
    if bias is None:
        return scale[:, None] * (codes.float() - ((1 << (bits - 1)) - 1))
    return bias[:, None] + scale[:, None] * codes.float()


def grid_error(rows: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Squared error per row of asymmetric quantization on the grid ``lo + scale * q`` (float64)."""
    x, lo, scale = rows.double(), lo.double(), scale.double()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.clamp((x - lo[:, None]) * inv[:, None], 0, (1 << bits) - 1).round()
    return ((x - lo[:, None] - scale[:, None] * q) ** 2).sum(dim=1)


def _refit(x: torch.Tensor, lo: torch.Tensor, s: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.clamp((x - lo[:, None]) * inv[:, None], 0, qmax).round()
    qc = q - q.mean(dim=1, keepdim=True)
    xc = x - x.mean(dim=1, keepdim=True)
    var, cov = (qc * qc).sum(dim=1), (qc * xc).sum(dim=1)
    ok = (var > 0) & (cov > 0)
    step = torch.where(ok, cov / torch.where(ok, var, 1.0), s)
    bias = torch.where(ok, x.mean(dim=1) - step * q.mean(dim=1), lo)
    return bias, step


def adaptive_search(
    rows: torch.Tensor, bits: int, num_bins: int, ratio: float, refit_iters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check-N-Run's greedy range search, then least-squares refits; float64.

    Rounds: move while range >= ratio * original, i.e. floor(num_bins * (1 - ratio)) + 1
    moves, never the move that would leave an empty range. A tie moves max down.
    """
    x = rows.double()
    qmax = (1 << bits) - 1
    mn, mx = x.min(dim=1).values, x.max(dim=1).values
    step = (mx - mn) / num_bins
    rounds = min(num_bins - 1, math.floor(num_bins * (1 - ratio) + 1e-9) + 1)
    best_lo, best_s = mn, (mx - mn) / qmax
    best_e = grid_error(x, best_lo, best_s, bits)
    ups = torch.zeros_like(mn)
    downs = torch.zeros_like(mn)
    for _ in range(rounds):
        lo_up, lo_keep = mn + (ups + 1) * step, mn + ups * step
        hi_keep, hi_down = mx - downs * step, mx - (downs + 1) * step
        s_up, s_down = (hi_keep - lo_up) / qmax, (hi_down - lo_keep) / qmax
        e_up, e_down = grid_error(x, lo_up, s_up, bits), grid_error(x, lo_keep, s_down, bits)
        up = e_up < e_down
        ups, downs = ups + up.double(), downs + (~up).double()
        e = torch.where(up, e_up, e_down)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_lo = torch.where(better, torch.where(up, lo_up, lo_keep), best_lo)
        best_s = torch.where(better, torch.where(up, s_up, s_down), best_s)
    if refit_iters > 0:
        lo, s = best_lo, best_s
        for _ in range(refit_iters):
            lo, s = _refit(x, lo, s, qmax)
        better = grid_error(x, lo, s, bits) < best_e
        best_lo, best_s = torch.where(better, lo, best_lo), torch.where(better, s, best_s)
    return best_lo.float(), best_s.float()


def exhaustive_search(rows: torch.Tensor, bits: int, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best of all ranges [min + i * r / grid, max - j * r / grid] with i + j < grid; float64."""
    x = rows.double()
    qmax = (1 << bits) - 1
    mn, mx = x.min(dim=1).values, x.max(dim=1).values
    r = mx - mn
    best_lo, best_s = mn, r / qmax
    best_e = grid_error(x, best_lo, best_s, bits)
    for i in range(grid):
        for j in range(grid - i):
            lo, hi = mn + r * (i / grid), mx - r * (j / grid)
            s = (hi - lo) / qmax
            e = grid_error(x, lo, s, bits)
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_lo, best_s = torch.where(better, lo, best_lo), torch.where(better, s, best_s)
    return best_lo.float(), best_s.float()


def kmeans(
    rows: torch.Tensor,
    bits: int,
    iters: int,
    codebook_dtype: torch.dtype,
    grid_bias: torch.Tensor | None = None,
    grid_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row k-means as the kernel specifies it; returns (codes uint8 [N, D], decoded centroids float32 [N, K]).

    K = min(2**bits, D). D <= 2**bits: the sorted row values. Otherwise Lloyd from the
    grid ``grid_bias + grid_scale * k`` (default: uniform over [min, max]); a value
    exactly on a midpoint joins the lower cluster, and an empty cluster keeps its
    centroid. Stored: smallest centroid in float32, the others as offsets from it
    rounded to ``codebook_dtype``; codes are the nearest stored centroid.
    """
    x = rows.double()
    n, d = x.shape
    k = min(1 << bits, d)
    mn, mx = x.min(dim=1).values, x.max(dim=1).values
    if d <= (1 << bits):
        c = x.sort(dim=1).values
    else:
        if grid_bias is None:
            c = mn[:, None] + (mx - mn)[:, None] * torch.arange(k, dtype=torch.float64) / (k - 1)
        else:
            assert grid_scale is not None  # a grid is given whole: its bias and scale
            c = grid_bias.double()[:, None] + grid_scale.double()[:, None] * torch.arange(k, dtype=torch.float64)
        for _ in range(iters):
            mids = (c[:, 1:] + c[:, :-1]) / 2
            code = (x[:, :, None] > mids[:, None, :]).sum(-1)
            onehot = torch.nn.functional.one_hot(code, k).double()
            cnt, tot = onehot.sum(dim=1), (onehot * x[:, :, None]).sum(dim=1)
            c = torch.where(cnt > 0, tot / cnt.clamp(min=1), c)
            c = torch.cummax(c, dim=1).values
    base = c[:, :1].float()
    offsets = round_param((c[:, 1:] - c[:, :1]).float(), codebook_dtype, 0)
    dec = torch.cat([base, base + offsets], dim=1)
    mids = (dec[:, 1:] + dec[:, :-1]) / 2
    codes = (rows[:, :, None] > mids[:, None, :]).sum(-1).to(torch.uint8)
    return codes, dec
