"""agree_round: every worker of a rendezvous round gets the same number, above every earlier round's; and the
job's failure report: a named error printed once per job, in one line.

The store is a real TCPStore that outlives the rounds, as torchrun's agent store does; the
workers of a round are threads, and a round can start while keys of a dead round are still
in the store.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError

from cnr_dlrm.failure import FailureReport
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


# ---------------------------------------------------------------------- the failure report


def _fail(store, round_number: int, rank: int, error: Exception, debug: bool = False) -> tuple[str, FailureReport]:
    """What rank ``rank`` prints for ``error``, raised and caught as the job does, and its report."""
    stream = io.StringIO()
    report = FailureReport(store, round_number, rank, debug=debug, stream=stream)
    try:
        raise error
    except type(error) as e:
        report.named(e)
    return stream.getvalue(), report


def test_a_named_error_is_one_line_once_per_job(server):
    message = ("rank 0, restoring checkpoint 0: checkpoint 0 is of another model (1 difference(s)): 't' is 4 x 8 "
               "in the model but 2 x 8 in the checkpoint. Use a new root, or restore with the model that wrote it")
    line = f"error: IncompatibleCheckpointError: {message}\n"
    # Round 1: every rank raises alike; rank 0 prints it, rank 1 points at rank 0, whatever order they come in.
    with ThreadPoolExecutor(2) as pool:
        out = list(pool.map(lambda r: _fail(_client(server), 1, r, IncompatibleCheckpointError(message)), [1, 0]))
    assert [printed for printed, _ in out] == ["rank 1 failed, see rank 0\n", line]
    assert out[0][1].reporter() == 0
    # Round 2 (torchrun restarted the job): the same error is not printed again.
    assert FailureReport(_client(server), 2, 0).reporter() is None  # nobody has failed in this round yet
    assert _fail(_client(server), 2, 0, IncompatibleCheckpointError(message))[0] == (
        "error: IncompatibleCheckpointError again after torchrun restarted the job (the same message as above)\n")
    # Round 3: another error is, in full; a rank that fails alone reports it itself.
    other = "ckpt-00000001/rank-00000.bin is truncated; restore an older checkpoint"
    assert _fail(_client(server), 3, 1, CorruptCheckpointError(other))[0] == (
        f"error: CorruptCheckpointError: {other}\n")
    # A one-rank job (no store); a message of several lines is still one line.
    assert _fail(None, 0, 0, IncompatibleCheckpointError("two\n  lines"))[0] == (
        "error: IncompatibleCheckpointError: two lines\n")


def test_debug_prints_the_traceback_first_and_a_broken_store_the_line(server):
    out, _ = _fail(_client(server), 1, 0, IncompatibleCheckpointError("use a new root"), debug=True)
    lines = out.splitlines()
    assert lines[0].startswith("Traceback") and "test_launch.py" in out
    assert lines[-1] == "error: IncompatibleCheckpointError: use a new root"

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("the agent is gone")

    out, report = _fail(Broken(), 1, 1, IncompatibleCheckpointError("use a new root"))
    assert out == "error: IncompatibleCheckpointError: use a new root\n"
    assert report.reporter() is None
