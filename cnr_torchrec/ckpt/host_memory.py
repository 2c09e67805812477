"""Host memory that residual coding keeps, and the check that a job has it before its first step.

With ``quantization.residual`` every rank keeps a float32 copy of its shards, the rows its chain
restores (:class:`~cnr_torchrec.ckpt.save.residual.Reconstruction`), and with background compaction
also its largest shard's sums and state while it folds the chain, and the folded rows at 8 bits
until the next delta hangs on them (:func:`fold_bytes`). Ranks on one host add up, so
the Checkpointer sums each host's ranks and compares the sum with what the host has available
(``MemAvailable``) when it is built. A job that would not fit is refused then, on every rank alike,
rather than swapping or being killed hours into training.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from cnr_torchrec.errors import ConfigError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["HostUse", "check_host_memory", "fold_bytes", "host_available_bytes", "host_uses", "reconstruction_bytes",
           "shard_states", "short_of_memory", "staging_bytes"]


def reconstruction_bytes(tracker: DirtyRowTracker) -> int:
    """Bytes of the float32 copy of this rank's shards that residual coding keeps."""
    return sum(shard.num_rows * (shard.cols[1] - shard.cols[0]) * 4
               for table in tracker.tables() for _, shard in tracker.shards(table))


def shard_states(tracker: DirtyRowTracker) -> Iterator[tuple[str, Any, list[torch.Tensor]]]:
    """(table, shard, its fused optimizer's state tensors) for every local shard; each TBE asked once."""
    asked: dict[int, list] = {}
    for table in tracker.tables():
        for kernel, shard in tracker.shards(table):
            tbe = kernel.tbe
            if id(tbe) not in asked:
                asked[id(tbe)] = tbe.split_optimizer_states() if hasattr(tbe, "split_optimizer_states") else []
            states = asked[id(tbe)]
            yield table, shard, list(states[shard.local_index]) if states else []


def staging_bytes(tracker: DirtyRowTracker) -> int:
    """Bytes a baseline copies to host memory before it writes (:mod:`~cnr_torchrec.ckpt.save.staging`): every
    local shard's weights and fused optimizer state, as they are stored."""
    weights: dict[int, list[torch.Tensor]] = {}  # each TBE's split weights, asked once
    total = 0
    for table in tracker.tables():
        for kernel, shard in tracker.shards(table):
            tbe = kernel.tbe
            w = weights.setdefault(id(tbe), tbe.split_embedding_weights())[shard.local_index]
            total += w.numel() * w.element_size()
    return total + sum(s.numel() * s.element_size() for _, _, states in shard_states(tracker) for s in states)


def fold_bytes(tracker: DirtyRowTracker) -> int:
    """Bytes a background compaction of a residual chain adds (:mod:`~cnr_torchrec.ckpt.compact.fold`): while it
    folds this rank's largest shard, its float32 sums, each optimizer state as float32 per value, and two masks
    of a byte per value; and until the delta that hangs on the fold commits, every shard's folded rows at
    8 bits (a byte per value, and a float32 scale and bias per row)."""
    largest = kept = 0
    for _, shard, states in shard_states(tracker):
        dim = shard.cols[1] - shard.cols[0]
        largest = max(largest, shard.num_rows * dim * (4 * (1 + len(states)) + 2))
        kept += shard.num_rows * (dim + 8)
    return largest + kept


def host_available_bytes() -> int | None:
    """``MemAvailable`` of this host (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostUse(NamedTuple):
    """One host: its ranks, the bytes they keep, and the bytes it has available (None: unknown)."""

    host: str
    ranks: int
    needed: int
    available: int | None


def host_uses(needed: int, *, distributed: bool) -> tuple[HostUse, list[HostUse]]:
    """Every rank's ``needed`` bytes, summed per host, beside what each host has available. Collective.

    Returns:
        This rank's host, and every host (sorted by name).
    """
    mine = (socket.gethostname(), int(needed), host_available_bytes())
    every: list[Any] = [mine]
    if distributed:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    hosts: dict[str, list] = {}
    for host, n, available in every:
        entry = hosts.setdefault(host, [host, 0, 0, available])
        entry[1] += 1
        entry[2] += n
    return HostUse(*hosts[mine[0]]), [HostUse(*h) for h in sorted(hosts.values())]


def short_of_memory(hosts: list[HostUse]) -> HostUse | None:
    """The first host whose ranks need more than it has available (unknown: never short), or None."""
    return next((h for h in hosts if h.available is not None and h.needed > h.available), None)


def check_host_memory(needed: int, *, distributed: bool, what: str = "a float32 copy of each rank's shards") -> HostUse:
    """Every rank's ``needed`` bytes, summed per host, against what each host has available. Collective.

    Returns:
        This rank's host: its name, ranks, the bytes they keep and the bytes available.

    Raises:
        ConfigError: on every rank, when the ranks of some host would keep more than it has available.
    """
    mine, hosts = host_uses(needed, distributed=distributed)
    short = short_of_memory(hosts)
    if short is not None:
        assert short.available is not None  # a host whose memory is unknown is never short
        raise ConfigError(
            f"quantization.residual keeps {what} in host memory: "
            f"{short.needed / 1e9:.2f} GB for the {short.ranks} rank(s) on host {short.host}, which has "
            f"{short.available / 1e9:.2f} GB available. Set quantization.residual: false, or run on more hosts so "
            "that each holds fewer rows")
    return mine
