"""Errors that reach every rank: a step one rank runs is shared with the others, failure included.

Code that runs on rank 0 alone (listing checkpoints, choosing the chain a restore takes)
and is followed by a collective must publish its outcome, or a failure on rank 0 leaves
the other ranks waiting in that collective until the process group times out.
:meth:`Ranks.from_rank0` runs a step on rank 0 and broadcasts either its JSON-able
result or a :class:`Failure`; :meth:`Ranks.raise_any` all-gathers each rank's own
outcome. Either way every rank raises the same named error, with the same message, which
names the rank and the original error; the rank where it happened chains the original
(``raise ... from``), so its traceback still shows where.

A failure travels as JSON (the name of a class in :mod:`cnr_torchrec.errors`, the
original error's type name and text), never as a pickled exception: an S3
``ClientError`` becomes :class:`~cnr_torchrec.errors.StorageError` on every rank,
whatever modules the other ranks have loaded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from cnr_torchrec import errors
from cnr_torchrec.errors import CheckpointError, CnrError, CorruptCheckpointError, StorageError

log = logging.getLogger(__name__)

__all__ = ["Failure", "Ranks", "as_named_error"]

# Top-level packages whose exceptions are storage failures (object-store clients and their HTTP stacks).
_STORAGE_PACKAGES = frozenset({"botocore", "aiobotocore", "aiohttp", "s3transfer", "urllib3", "google", "fsspec"})


def _all_gather_single(out: torch.Tensor, local: torch.Tensor) -> None:
    """``dist.all_gather_single``: torch 2.13 renamed ``all_gather_into_tensor`` to it, and the old name warns
    (FutureWarning) on every call; an older torch has the old name only."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local)


def _is_storage_error(e: BaseException) -> bool:
    """An I/O error, or one raised by an object-store client (botocore's ClientError, say)."""
    return isinstance(e, OSError) or any(c.__module__.split(".")[0] in _STORAGE_PACKAGES for c in type(e).__mro__)


def _named_class(e: BaseException) -> type[CnrError]:
    """The class in :mod:`cnr_torchrec.errors` that every rank raises for ``e``."""
    if isinstance(e, CnrError):
        # The nearest class that errors.py defines: the name must resolve on every rank.
        return next(c for c in type(e).__mro__ if c.__module__ == errors.__name__ and issubclass(c, CnrError))
    return StorageError if _is_storage_error(e) else CheckpointError



def heard(store: Any, result_key: str, heard_key: str, world_size: int) -> None:
    """Counts one more of the ``world_size - 1`` ranks that wait for rank 0's outcome at ``result_key`` as having
    heard it; the last to hear it deletes both keys, so that the store holds nothing of the step once every rank
    knows how it ended. A store that is gone (it may live in rank 0's process) is left as it is.
    """
    try:
        if store.add(heard_key, 1) == world_size - 1:
            store.delete_key(result_key)
            store.delete_key(heard_key)
    except Exception as e:  # noqa: BLE001 - the outcome was heard; clearing the store is housekeeping
        log.debug("could not clear %s from the store: %s", result_key, e)


@dataclass(frozen=True)
class Failure:
    """What went wrong on one rank, in a form every rank can rebuild into the same error.

    Attributes:
        rank: where it happened.
        kind: the class to raise, by its name in :mod:`cnr_torchrec.errors`.
        cause: the original error's type name (``ClientError``, ``OSError``...).
        message: the original error's text.
        what: the step that failed ("choosing the checkpoint to restore").
        path: the file a CorruptCheckpointError or CheckpointNotFoundError names, if any.
        named: the original error was one of ours (its message already says what to do).
    """

    rank: int
    kind: str
    cause: str
    message: str
    what: str
    path: str = ""
    named: bool = True

    @classmethod
    def of(cls, e: BaseException, rank: int, what: str) -> Failure:
        """Describes ``e``, raised on ``rank`` while doing ``what``."""
        return cls(rank=rank, kind=_named_class(e).__name__, cause=type(e).__name__, message=str(e), what=what,
                   path=str(getattr(e, "path", "") or ""), named=isinstance(e, CnrError))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Failure:
        return cls(**d)

    @property
    def file_problem(self) -> bool:
        """A file that is corrupt or missing (restore may fall back to an older checkpoint)."""
        return self.kind in ("CorruptCheckpointError", "CheckpointNotFoundError")

    def error(self) -> CnrError:
        """The named error, with the same message on every rank."""
        cls = getattr(errors, self.kind, None)
        if not (isinstance(cls, type) and issubclass(cls, CnrError)):
            cls = CheckpointError
        where = f"rank {self.rank}, {self.what}"
        if cls is StorageError and not self.named:
            message = (f"{where}: the storage failed with {self.cause}: {self.message}. Check that the checkpoint "
                       "root is reachable, that this job's credentials may read and write it and that it has space, "
                       "then try again on every rank")
        elif not self.named:
            message = (f"{where}: unexpected {self.cause}: {self.message}. This is a bug in cnr_torchrec or in a "
                       f"storage plugin; the traceback on rank {self.rank} shows where, please report it")
        else:
            message = f"{where}: {self.message}"
        if issubclass(cls, CorruptCheckpointError):
            return cls(message, path=self.path)
        err = cls(message)
        if self.path:
            err.path = self.path  # type: ignore[attr-defined]  # as Storage's CheckpointNotFoundError has
        return err


def as_named_error(e: BaseException, rank: int, what: str) -> CnrError:
    """``e`` as the named error every rank would raise for it (for steps that are not collective)."""
    return Failure.of(e, rank, what).error()


class Ranks:
    """The ranks of the default process group, as the checkpoint code talks to them.

    Objects travel as JSON in uint8 tensors, never pickled; on NCCL the tensors go
    through the current CUDA device. Without a process group this is a world of one.
    """

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1

    @property
    def device(self) -> torch.device:
        """Where collective tensors live: the current CUDA device on NCCL, else the CPU."""
        if self.distributed and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def from_rank0(self, fn: Callable[[], Any], *, what: str) -> Any:
        """Runs ``fn`` on rank 0 alone and returns its JSON-able result on every rank.

        Every rank must call it at once; only rank 0 calls ``fn``.

        Args:
            fn: the step; what it returns must be JSON-able.
            what: the step in words, for the error message ("choosing the checkpoint to restore").

        Raises:
            CnrError: ``fn`` raised on rank 0: the same named error on every rank (StorageError
                for an I/O or object-store error), naming rank 0 and the original error.
        """
        cause: BaseException | None = None
        data = b""
        if self.rank == 0:
            try:
                data = json.dumps({"ok": fn()}, allow_nan=False).encode()
            except Exception as e:  # every rank must hear of it before it waits below
                cause = e
                data = json.dumps({"failure": Failure.of(e, 0, what).to_json()}).encode()
        outcome = json.loads(self._broadcast_bytes(data))
        if "failure" in outcome:
            raise Failure.from_json(outcome["failure"]).error() from cause
        return outcome["ok"]

    def raise_any(self, failure: Failure | None, cause: BaseException | None = None) -> None:
        """Shares each rank's outcome; if any rank failed, raises the lowest such rank's error on every rank.

        Args:
            failure: this rank's failure, or None if its step succeeded.
            cause: the exception behind ``failure``, chained on this rank.

        Raises:
            CnrError: the first failure's named error, alike on every rank.
        """
        for f in self.failures(failure):
            raise f.error() from (cause if f.rank == self.rank else None)

    def failures(self, failure: Failure | None) -> list[Failure]:
        """Every rank's failure (lowest rank first); empty when every rank succeeded."""
        everyone = self.exchange(None if failure is None else failure.to_json())
        return [Failure.from_json(s) for s in everyone if s is not None]

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able ``obj``, on every rank, in rank order."""
        if not self.distributed:
            return [obj]
        data = json.dumps(obj).encode()
        sizes = self.all_gather(torch.tensor([len(data)], dtype=torch.int64)).view(-1)
        width = int(sizes.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self.all_gather(mine)
        return [json.loads(bytes(rows[r, : int(sizes[r])].numpy())) for r in range(self.world_size)]

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` (the same shape and dtype on every rank), stacked in rank order, on the CPU.

        Args:
            local: this rank's tensor, on any device.

        Returns:
            A tensor of shape ``(world_size, *local.shape)``; ``local`` alone, stacked, without a process group.
        """
        if not self.distributed:
            return local.detach().cpu().unsqueeze(0)
        dev = self.device
        out = torch.empty(self.world_size * local.numel(), dtype=local.dtype, device=dev)
        _all_gather_single(out, local.reshape(-1).to(dev))
        return out.cpu().view(self.world_size, *local.shape)

    def _broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass anything)."""
        if not self.distributed:
            return data
        dev = self.device
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        dist.broadcast(size, src=0)
        n = int(size.item())
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if self.rank == 0
               else torch.empty(n, dtype=torch.uint8, device=dev))
        dist.broadcast(buf, src=0)
        return bytes(buf.cpu().numpy())
