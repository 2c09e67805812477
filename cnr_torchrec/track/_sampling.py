"""SSU's sample of a lookup's ids: Bernoulli(``rate``) per id, from the tracker's own generator."""

from __future__ import annotations

import math

import torch

__all__ = ["sample_lookup"]


def _sample_positions(n: int, rate: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Sorted positions kept by independent Bernoulli(``rate``) trials over positions ``0..n-1``.

    Drawn as the geometric gaps between kept positions, ``floor(log(1 - U) / log(1 - rate)) + 1``
    for uniform ``U``: about ``n * rate`` draws instead of ``n``. Gaps are memoryless, so a
    chunk that falls short is continued from its last position. The result may run past
    ``n - 1``; callers ignore those positions.
    """
    expected = n * rate
    chunk = int(expected + 8.0 * expected**0.5 + 16)
    scale = 1.0 / math.log1p(-rate)
    parts, last = [], -1
    while last < n - 1:
        u = torch.rand(chunk, generator=generator, device=device)
        # The float is >= 0, so truncation is floor; the clamp only guards absurdly small rates.
        gaps = u.neg_().log1p_().mul_(scale).clamp_(max=2.0**62).to(torch.int64).add_(1)
        pos = torch.cumsum(gaps, 0).add_(last)
        parts.append(pos)
        last = int(pos[-1])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _sample_lookups(
    indices: torch.Tensor, offsets: torch.Tensor, rate: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Bernoulli(``rate``) sample of a lookup's ids, as ``(indices, offsets)`` over the same bags.

    Kept ids keep their order, and each bag's offset becomes the number of ids kept
    before it: a cumsum of the kept mask. Positions past the last offset are never read.
    """
    n = indices.numel()
    if n == 0:
        return indices, torch.zeros_like(offsets)
    pos = _sample_positions(n, rate, generator, indices.device).clamp_(max=n)
    kept = indices.index_select(0, pos.clamp(max=n - 1))
    mask = torch.zeros(n + 1, dtype=torch.bool, device=indices.device)
    mask[pos] = True  # slot n collects every position past the ids, and is never counted
    before = torch.zeros(n + 1, dtype=torch.int64, device=indices.device)
    torch.cumsum(mask[:n], 0, out=before[1:])
    return kept, before[offsets.long()]


def _mask_lookups(indices: torch.Tensor, rate: float, generator: torch.Generator) -> torch.Tensor:
    """The same sample as ids of -1 (which ``mark_rows`` skips) in place of the ids left out.

    One draw per id, but no compaction: nothing about the sample's size is read on the
    host, so a CUDA step never waits for it.
    """
    keep = torch.rand(indices.numel(), generator=generator, device=indices.device) < rate
    return indices.masked_fill(~keep, -1)


def sample_lookup(
    indices: torch.Tensor, offsets: torch.Tensor, rate: float, generator: torch.Generator, *, sync_free: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Bernoulli(``rate``) sample of a lookup's ids, as ``(indices, offsets)`` for ``mark_rows``.

    Args:
        indices, offsets: the lookup.
        rate: the probability that an id is kept, in (0, 1).
        generator: the tracker's own generator, on the ids' device.
        sync_free: draw the sample without any read on the host (ids left out become
            -1, offsets unchanged). Otherwise it is drawn as gaps between kept ids:
            about ``n * rate`` draws instead of ``n``, which is cheaper on CPU.
    """
    if sync_free:
        return _mask_lookups(indices, rate, generator), offsets
    return _sample_lookups(indices, offsets, rate, generator)
