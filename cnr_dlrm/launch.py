"""Process-group start-up for the training job, on one node or several, across torchrun restarts.

torchrun's c10d rendezvous hands its workers one TCPStore that outlives every restart of the
job (``TORCHELASTIC_USE_AGENT_STORE``), and ``env://`` uses it without a prefix, so a
restarted group can read the dead group's gloo addresses and hang (pytorch/pytorch#135712).
Workers therefore need a key prefix that every worker of one round shares and no earlier
round used. ``TORCHELASTIC_RESTART_COUNT`` is not one: on several nodes, only the agent whose
worker failed counts a restart; the others restart their workers for the new round with the
count unchanged.

:func:`agree_round` gets the prefix from the store itself. Global rank 0 takes a fresh round
number with an atomic ``add``; every other worker posts a token no earlier worker could have
posted, and rank 0 answers each token it reads until every rank has acknowledged the round.
A stale request costs rank 0 one answer nobody reads, and a stale answer is never read,
because no new worker asks under an old token. Under ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
the store is new each round and the handshake just returns round 1.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Launch", "agree_round", "init_distributed"]

_KEY = "cnr/round"


def agree_round(store: dist.Store, rank: int, world: int, timeout: timedelta = timedelta(minutes=10)) -> int:
    """The number of this rendezvous round, the same on every rank and larger than any earlier round's.

    Raises:
        RuntimeError: some rank did not take part within ``timeout`` (it names them).
    """
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"{_KEY}/ask/{rank}", token)
        store.wait([f"{_KEY}/answer/{token}"], timeout)
        number = int(store.get(f"{_KEY}/answer/{token}"))
        store.set(f"{_KEY}/{number}/ack/{rank}", b"1")
        return number
    number = store.add(f"{_KEY}/counter", 1)
    answered: dict[int, bytes] = {}
    waiting = set(range(1, world))
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for r in sorted(waiting):
            if store.check([f"{_KEY}/{number}/ack/{r}"]):
                waiting.discard(r)
            elif store.check([f"{_KEY}/ask/{r}"]):
                token = store.get(f"{_KEY}/ask/{r}")
                if answered.get(r) != token:
                    store.set(f"{_KEY}/answer/{token.decode()}", str(number))
                    answered[r] = token
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"rank 0: ranks {sorted(waiting)} did not join round {number} of the job within "
                               f"{timeout}; check that every node's torchrun uses the same --rdzv-endpoint and "
                               "--nnodes")
        if waiting:
            time.sleep(0.01)
    return number


@dataclass(frozen=True)
class Launch:
    """What :func:`init_distributed` started.

    Attributes:
        device: this rank's device.
        incarnation: the rounds of the job before this one (0 for its first start), the same on every rank.
        store: torchrun's rendezvous store, which outlives the job's restarts; None for a plain one-rank run.
        round_number: this round's number in ``store`` (0 without one).
    """

    device: torch.device
    incarnation: int
    store: dist.Store | None = None
    round_number: int = 0


def init_distributed() -> Launch:
    """Starts the default process group (gloo on CPU, nccl on GPU).

    Under torchrun the group's keys live under a prefix of this round (:func:`agree_round`), and
    the incarnation counts the rounds before it: 0 for the job's first start, the same on every
    rank. (With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every round has a new store, and the
    incarnation falls back to this node's restart count.) A plain ``python -m
    cnr_dlrm.train`` is one rank, incarnation 0, with a file rendezvous.
    """
    incarnation, store, number = 0, None, 0
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        store, rank, world = next(dist.rendezvous("env://"))
        number = agree_round(store, rank, world)
        incarnation = max(number - 1, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
        dist.init_process_group(backend, store=dist.PrefixStore(f"cnr/round-{number}", store), rank=rank,
                                world_size=world)
    else:
        fd, path = tempfile.mkstemp(prefix="cnr-rdzv-")
        os.close(fd)
        os.remove(path)
        dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return Launch(device, incarnation, store, number)
