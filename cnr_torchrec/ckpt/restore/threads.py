"""How many cores a restore decodes on.

The decoding ops (``dequantize_uniform_into_``, ``row_crc32c``, ``scatter_rows_``, ...) split
their rows over ATen's intra-op threads with the GIL released. A job started by torchrun
usually runs with one such thread per rank (torchrun sets ``OMP_NUM_THREADS=1`` when a node
runs several ranks), which is right for training and leaves the other cores idle while a
restore decodes. So a restore widens the pool to the cores this rank may use, and puts it
back afterwards. Training is stopped while a restore runs, so nothing else needs those cores.

Every kernel decodes a row the same way on any thread, so the restored values do not depend
on the thread count.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

__all__ = ["decode_threads", "wider_pool"]

log = logging.getLogger(__name__)


def decode_threads(configured: int | None = None) -> int:
    """The threads a restore decodes with on this rank: ``configured``, or the rank's share of the cores.

    A rank's share: the cores of its CPU affinity when it is pinned to fewer than the machine's
    (a launcher that pins ranks has split the cores already), else the machine's cores over the
    ranks on this node (``LOCAL_WORLD_SIZE``, set by torchrun), at least 1.
    """
    if configured is not None:
        return configured
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if allowed < (os.cpu_count() or allowed):
        return max(1, allowed)
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, allowed // local)


@contextlib.contextmanager
def wider_pool(threads: int) -> Iterator[None]:
    """ATen's intra-op pool at ``threads`` (never narrower than it is) inside the block, as it was after."""
    before = torch.get_num_threads()
    if threads > before:
        torch.set_num_threads(threads)
        log.debug("restore: decoding on %d threads (the pool had %d)", threads, before)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
