"""Named exceptions. Each message says what to do about it."""

__all__ = [
    "CnrError",
    "CompactionError",
    "UnsupportedShardingError",
    "UnsupportedStackError",
    "RowIdOutOfRangeError",
    "MalformedLookupError",
    "UnknownTableError",
    "TrackingNotEnabledError",
    "ConfigError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointerClosedError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "RestoreFailedError",
    "SaveFailedError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnauthenticatedCheckpointError",
    "one_line",
]


class CnrError(Exception):
    """Base class of every cnr_torchrec error."""


def one_line(error: BaseException) -> str:
    """``error`` as its class name and its message on one line, as the ``cnr`` command and the example job print it.

    Args:
        error: usually a CnrError, whose message already says what to do.

    Returns:
        ``"<ClassName>: <message>"``, the message's lines joined by spaces.
    """
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class UnsupportedShardingError(CnrError, ValueError):
    """A sharded table cannot be tracked: its kernel is not an FBGEMM TBE, or its compute kernel is unsupported."""


class UnsupportedStackError(CnrError, RuntimeError):
    """A mixed build of the TorchRec stack (two fbgemm builds, or one that does not fit torch's build)."""


class RowIdOutOfRangeError(CnrError, IndexError):
    """A training batch looked up an id outside its table."""


class MalformedLookupError(CnrError, ValueError):
    """A training lookup whose offsets or per-sample weights do not fit its ids."""


class UnknownTableError(CnrError, KeyError):
    """A table name that the tracked model does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TrackingNotEnabledError(CnrError, RuntimeError):
    """A tracker view (baseline bitmap, lookup counters) that was not enabled at construction."""


class ConfigError(CnrError, ValueError):
    """A checkpoint config with an unknown key, a wrong type or an inconsistent value."""


class CheckpointError(CnrError):
    """Base class of the errors raised while saving or restoring checkpoints."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint matches the request: there is nothing to restore (a fresh start is right)."""


class RestoreFailedError(CheckpointError, RuntimeError):
    """Committed checkpoints exist, but none of them could be restored; the model is left as it was.

    Deliberately not a :class:`CheckpointNotFoundError`: a job that starts afresh when there is no
    checkpoint must not start afresh when its checkpoints are unreadable.

    Attributes:
        skipped: checkpoint id -> why it could not be restored (the file, on which rank).
    """

    def __init__(self, message: str, skipped: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.skipped = dict(skipped or {})


class CheckpointerClosedError(CheckpointError, RuntimeError):
    """A Checkpointer was used after ``close()``, which released its threads and its storage."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint file is missing, truncated, or does not match its checksum.

    Attributes:
        path: the file, relative to the checkpoint root.
    """

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """A checkpoint of another model: a table is missing, extra, or has another shape."""


class CompactionError(CheckpointError, RuntimeError):
    """A chain that cannot be merged into a baseline without re-encoding rows; the chain is kept as it is."""


class SaveFailedError(CheckpointError, RuntimeError):
    """A save did not commit. The previous checkpoint is untouched."""


class StorageError(CheckpointError, OSError):
    """The storage under the checkpoint root failed: an I/O error, or an object store's error (an S3 ``ClientError``).

    Raised on every rank alike, with a message naming the rank it happened on and the
    original error. Nothing under the root was changed by the step that raised it.
    """


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A checkpoint names a file outside its root, or asks for something we never load (pickle)."""


class UnauthenticatedCheckpointError(UnsafeCheckpointError):
    """A manifest of an authenticated root (``integrity`` in the config) that the key does not vouch for: written
    without the key or with another one, or altered after it was sealed; or a keyed root read without its key.

    Refused under both ``on_corrupt`` settings, never skipped for an older checkpoint.

    Attributes:
        path: the manifest, relative to the checkpoint root.
    """

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path
