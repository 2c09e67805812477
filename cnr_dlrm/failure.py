"""How the training job reports a named error (a CnrError): one line, once per job, whatever the ranks.

Every rank of a restore raises the same error (the library's error protocol), and torchrun
restarts the job after a failure, so a plain ``raise`` prints the traceback on every rank, in
every incarnation. Instead, the first failing rank of a round claims the report in the
rendezvous store and prints the error as one line (its class, and the message that says what to
do); every other failing rank prints ``rank N failed, see rank M``. The store outlives
torchrun's restarts, so an incarnation that fails with the message an earlier one printed says
so in a short line instead of repeating it. ``--debug`` prints each failing rank's traceback
first. Errors that are not CnrError (bugs) are not reported here: they keep their traceback.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from typing import TextIO

import torch.distributed as dist

from cnr_torchrec.errors import CnrError, one_line

__all__ = ["FailureReport"]

log = logging.getLogger(__name__)

_MESSAGE = "cnr/failure/message"  # the last message printed, across rounds
# Why rank 0 claims first: when every rank raises alike, the report comes from rank 0, whose lines a reader
# looks at first. A rank that fails alone claims after this delay all the same.
_DEFER_S = 0.2


class FailureReport:
    """The job's failure report on one rank.

    Args:
        store: the rendezvous store that outlives torchrun's restarts (None for a one-rank job).
        round_number: this rendezvous round's number in it (claims are per round).
        rank: this process's global rank.
        debug: print the traceback of each failing rank before its line.
        stream: where to print (stderr).
    """

    def __init__(self, store: dist.Store | None, round_number: int, rank: int, debug: bool = False,
                 stream: TextIO | None = None) -> None:
        self._store = store
        self._claim = f"cnr/failure/round-{round_number}"
        self.rank = rank
        self.debug = debug
        self._stream = stream

    def _print(self, line: str) -> None:
        stream = self._stream or sys.stderr
        print(line, file=stream, flush=True)

    def named(self, error: CnrError) -> None:
        """Reports ``error``, raised on this rank: the line, or a pointer to the rank that printed it.

        Call it from the ``except`` block, so that ``--debug`` can print the traceback.
        """
        if self.debug:
            traceback.print_exc(file=self._stream or sys.stderr)
        line = f"error: {one_line(error)}"
        if self._store is None:
            self._print(line)
            return
        try:
            if self.rank != 0:
                time.sleep(_DEFER_S)
            reporter = int(self._store.compare_set(self._claim, "", str(self.rank)))
            if reporter != self.rank:
                self._print(f"rank {self.rank} failed, see rank {reporter}")
                return
            before = self._store.get(_MESSAGE).decode() if self._store.check([_MESSAGE]) else None
            self._store.set(_MESSAGE, line)
        except Exception as e:  # noqa: BLE001  (the store is torchrun's; without it, every rank says it all)
            log.debug("failure report: the store failed (%s)", e)
            self._print(line)
            return
        if before == line:
            self._print(f"error: {type(error).__name__} again after torchrun restarted the job (the same message "
                        "as above)")
        else:
            self._print(line)

    def reporter(self) -> int | None:
        """The rank that reported a named error in this round, if any (for a rank whose peer died of it)."""
        if self._store is None:
            return None
        try:
            return int(self._store.get(self._claim)) if self._store.check([self._claim]) else None
        except Exception:  # noqa: BLE001
            return None
