"""The job's failure report over many torchrun rounds: "the same message as above" means the round before.

A job that torchrun restarts again and again can fail with one error, then another, then the first
again. Each round's reporter compares its line with the last line printed, in whichever round
that was, so the message it says is "above" is always the newest one; a report that remembered
only the first round's message would repeat the second error in full and call a return of the
first "the same message as above", under the second's lines. The store is a real TCPStore that
outlives the rounds, as torchrun's agent store does; the ranks of a round are threads, and each
round builds its reports and store clients anew, as a restarted worker does.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from cnr_torchrec.errors import CnrError, CorruptCheckpointError, IncompatibleCheckpointError, StorageError

from cnr_dlrm.failure import FailureReport

OTHER_MODEL = IncompatibleCheckpointError("checkpoint 0 is of another model; use a new root")
TRUNCATED = CorruptCheckpointError("ckpt-00000003/rank-00000.bin is truncated; restore an older checkpoint")
NO_SPACE = StorageError("rank 1: [Errno 28] No space left on device; free space under the root")


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _printed(server, round_number: int, rank: int, error: CnrError) -> str:
    """What rank ``rank`` of a new incarnation prints for ``error`` in round ``round_number``."""
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    stream = io.StringIO()
    report = FailureReport(client, round_number, rank, stream=stream)
    try:
        raise error
    except CnrError as e:
        report.named(e)
    return stream.getvalue()


def _round(server, round_number: int, errors: dict[int, CnrError]) -> dict[int, str]:
    """Every failing rank of one round (rank -> its error), concurrently: rank -> what it printed."""
    with ThreadPoolExecutor(len(errors)) as pool:
        futures = {r: pool.submit(_printed, server, round_number, r, e) for r, e in errors.items()}
        return {r: f.result(timeout=30) for r, f in futures.items()}


def _full(error: CnrError) -> str:
    return f"error: {type(error).__name__}: {error}\n"


def _again(error: CnrError) -> str:
    return (f"error: {type(error).__name__} again after torchrun restarted the job (the same message as "
            "above)\n")


@pytest.mark.timeout(60)
def test_each_round_compares_with_the_message_printed_last(server):
    # (failing ranks and their errors, what each prints): A, A, B, B, A, A, C, A.
    rounds = [
        ({0: OTHER_MODEL, 1: OTHER_MODEL}, {0: _full(OTHER_MODEL), 1: "rank 1 failed, see rank 0\n"}),
        ({0: OTHER_MODEL, 1: OTHER_MODEL}, {0: _again(OTHER_MODEL), 1: "rank 1 failed, see rank 0\n"}),
        ({1: TRUNCATED}, {1: _full(TRUNCATED)}),  # a rank that fails alone reports it itself
        ({0: TRUNCATED}, {0: _again(TRUNCATED)}),
        ({0: OTHER_MODEL, 1: OTHER_MODEL}, {0: _full(OTHER_MODEL), 1: "rank 1 failed, see rank 0\n"}),
        ({0: OTHER_MODEL}, {0: _again(OTHER_MODEL)}),
        ({1: NO_SPACE}, {1: _full(NO_SPACE)}),
        ({0: OTHER_MODEL}, {0: _full(OTHER_MODEL)}),
    ]
    for number, (errors, want) in enumerate(rounds, start=1):
        assert _round(server, number, errors) == want, f"round {number}"


@pytest.mark.timeout(60)
def test_a_round_of_the_same_class_with_another_message_prints_it_in_full(server):
    """The comparison is of the whole line: the same class with a new message is news, in any round."""
    first = IncompatibleCheckpointError("checkpoint 0 is of another model; use a new root")
    second = IncompatibleCheckpointError("checkpoint 4 is of another model; use a new root")
    printed = [_printed(server, number, 0, error) for number, error in
               enumerate([first, first, first, second, second, first], start=1)]
    assert printed == [_full(first), _again(first), _again(first), _full(second), _again(second), _full(first)]
