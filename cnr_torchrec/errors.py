"""Named exceptions. Each message says what to do about it."""

__all__ = [
    "CnrError",
    "UnsupportedShardingError",
    "RowIdOutOfRangeError",
    "UnknownTableError",
    "TrackingNotEnabledError",
]


class CnrError(Exception):
    """Base class of every cnr_torchrec error."""


class UnsupportedShardingError(CnrError, ValueError):
    """A sharded table cannot be tracked: its kernel is not an FBGEMM TBE, or its compute kernel is unsupported."""


class RowIdOutOfRangeError(CnrError, IndexError):
    """A training batch looked up an id outside its table."""


class UnknownTableError(CnrError, KeyError):
    """A table name that the tracked model does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TrackingNotEnabledError(CnrError, RuntimeError):
    """A tracker view (baseline bitmap, lookup counters) that was not enabled at construction."""
