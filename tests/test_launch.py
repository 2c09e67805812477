"""agree_round: every worker of a rendezvous round gets the same number, above every earlier round's.

The store is a real TCPStore that outlives the rounds, as torchrun's agent store does; the
workers of a round are threads, and a round can start while keys of a dead round are still
in the store.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from cnr_dlrm.launch import agree_round


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def _round(server, world: int, order: list[int]) -> list[int]:
    """The round numbers that ``world`` workers get, started in ``order`` (rank 0 anywhere in it)."""
    got = [0] * world
    with ThreadPoolExecutor(world) as pool:
        futures = {r: pool.submit(agree_round, _client(server), r, world, timedelta(seconds=20)) for r in order}
        for r, f in futures.items():
            got[r] = f.result()
    return got


def test_every_round_agrees_on_a_new_number_even_with_stale_keys(server):
    assert _round(server, 3, [0, 1, 2]) == [1, 1, 1]
    # A worker of a round that died after asking: its stale ask is answered and never read.
    _client(server).set("cnr/round/ask/2", "stale-token")
    assert _round(server, 3, [2, 1, 0]) == [2, 2, 2]
    # A smaller world next (an elastic job that lost a node).
    assert _round(server, 2, [1, 0]) == [3, 3]


def test_a_missing_rank_is_named_after_the_timeout(server):
    done = threading.Event()

    def rank1():
        agree_round(_client(server), 1, 3, timedelta(seconds=5))
        done.set()

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    with pytest.raises(RuntimeError, match=r"ranks \[2\] did not join round 1"):
        agree_round(_client(server), 0, 3, timedelta(seconds=1))
    assert done.wait(5)
