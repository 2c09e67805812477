"""Named errors of the row codecs. Each message says what to do about it."""

from __future__ import annotations

from cnr_torchrec.errors import CnrError

__all__ = [
    "UnknownCodecError",
    "InvalidRowsError",
    "NonFiniteRowsError",
    "RowOverflowError",
    "EncodingFormatError",
]


class UnknownCodecError(CnrError, ValueError):
    """An unknown codec method, an unsupported bit width, or an unknown or invalid codec parameter."""


class InvalidRowsError(CnrError, TypeError, ValueError):
    """Rows that are not a 2-D float32 tensor with at least one column."""


class NonFiniteRowsError(CnrError, ValueError):
    """Rows to encode hold NaN or Inf values; nothing was encoded.

    Attributes:
        num_rows: how many rows hold a NaN or an Inf.
        row_indices: the indices (in the encoded batch) of the first few such rows.
    """

    def __init__(self, num_rows: int, row_indices: list[int]) -> None:
        self.num_rows = num_rows
        self.row_indices = row_indices
        super().__init__(
            f"{num_rows} row(s) hold NaN or Inf values (first at row indices {row_indices}); "
            "refusing to encode them. Check the training job for divergence before checkpointing."
        )


class RowOverflowError(CnrError, ValueError):
    """Finite rows whose values (or per-row parameters) do not fit the codec's storage dtype.

    Attributes:
        num_rows: how many rows overflow.
        row_indices: the indices of the first few such rows.
    """

    def __init__(self, num_rows: int, row_indices: list[int], hint: str) -> None:
        self.num_rows = num_rows
        self.row_indices = row_indices
        super().__init__(
            f"{num_rows} row(s) (first at row indices {row_indices}) hold values that the storage dtype cannot "
            f"represent; {hint}"
        )


class EncodingFormatError(CnrError, ValueError):
    """Encoded rows whose tensors or metadata are inconsistent (corrupt, or written by another codec)."""
