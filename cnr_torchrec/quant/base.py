"""The row-codec interface (:class:`Codec`) and what its families share: parameter specs and status checks.

The families live one to a module (``floats``, ``uniform``, ``kmeans``); ``registry`` names them by method.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from cnr_torchrec import ops as cnr_ops
from cnr_torchrec.quant import ops
from cnr_torchrec.quant.encoded import EncodedRows
from cnr_torchrec.quant.errors import (
    EncodingFormatError,
    InvalidRowsError,
    NonFiniteRowsError,
    UnknownCodecError,
)

__all__ = ["PARAM_DTYPES", "QUANT_BITS", "Codec", "Layout", "Param", "check_status", "dtype_param", "fraction_param",
           "int_param", "overflow_rows"]

QUANT_BITS: tuple[int, ...] = (2, 3, 4, 8)
"""Bit widths of the quantizing methods."""

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""The tensors of an encoding: ``{name: (dtype, shape)}``."""

PARAM_DTYPES = {"float16": torch.float16, "float32": torch.float32}
"""The dtypes a codec's per-row parameters may be stored as, by the name its params give."""
_MAX_REPORTED_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter a codec family takes: its default, what accepts a value, and what a valid value looks like."""

    default: Any
    valid: Callable[[Any], bool]
    expect: str  # what a valid value looks like, for error messages


def dtype_param(default: str) -> Param:
    """A parameter naming a dtype of :data:`PARAM_DTYPES`."""
    return Param(default, lambda v: v in PARAM_DTYPES, "'float16' or 'float32'")


def int_param(default: int, lo: int, hi: int) -> Param:
    """An int parameter in ``[lo, hi]``."""
    def valid(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    return Param(default, valid, f"an int in [{lo}, {hi}]")


def fraction_param(default: float) -> Param:
    """A number parameter in ``(0, 1]``."""
    def valid(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1

    return Param(default, valid, "a number in (0, 1]")


class Codec(abc.ABC):
    """Encodes float32 rows ``[N, D]`` into :class:`EncodedRows` and back.

    Call order:
        0. ``codec = get_codec(method, bits, **params)``;
        1. ``encoded = codec.encode(rows)``: rows are float32 ``[N, D]``, N may be 0;
        2. store ``encoded.to_tensors()`` and ``encoded.metadata()`` (no pickle needed);
        3. ``encoded = cnr_torchrec.quant.rebuild(tensors, metadata)`` (checked against the codec's layout);
        4. ``rows_hat = codec.decode(encoded)``, or ``cnr_torchrec.quant.decode(encoded)``,
           which rebuilds the codec from the metadata.

    Encoding is deterministic: the same rows give the same bytes whatever the thread
    count. Subclasses implement ``_encode``, ``_decode``, ``layout`` and ``bytes_per_row``.
    """

    method: ClassVar[str]
    bit_choices: ClassVar[tuple[int, ...]]
    param_specs: ClassVar[dict[str, Param]] = {}

    def __init__(self, bits: int, params: Mapping[str, Any]) -> None:
        self._bits = bits
        self._params = {name: spec.default for name, spec in self.param_specs.items()}
        for name, value in params.items():
            spec = self.param_specs.get(name)
            if spec is None:
                valid = ", ".join(sorted(self.param_specs)) or "none"
                raise UnknownCodecError(f"codec {self.method!r} has no parameter {name!r}; its parameters: {valid}")
            if not spec.valid(value):
                raise UnknownCodecError(f"codec {self.method!r}: {name}={value!r} is invalid; expected {spec.expect}")
            self._params[name] = value
        self._validate()

    @property
    def bits(self) -> int:
        """Bits per value (32 for ``none``, 16 for ``fp16`` and ``bf16``)."""
        return self._bits

    @property
    def params(self) -> dict[str, Any]:
        """All parameters, defaults included (JSON-able)."""
        return dict(self._params)

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        """Encodes rows.

        Args:
            rows: float32 ``[N, D]``, D >= 1.

        Returns:
            The encoded rows.

        Raises:
            InvalidRowsError: ``rows`` is not a 2-D float32 tensor with at least one column.
            NonFiniteRowsError: some rows hold NaN or Inf; nothing is encoded.
            RowOverflowError: some finite rows cannot be represented (e.g. beyond ±65504 for fp16).
        """
        if not isinstance(rows, torch.Tensor):
            raise InvalidRowsError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        if rows.dtype != torch.float32:
            raise InvalidRowsError(f"rows must be float32, got {rows.dtype}; convert them with rows.float() first")
        if rows.dim() != 2 or rows.shape[1] == 0:
            raise InvalidRowsError(f"rows must be 2-D [N, D] with D >= 1, got shape {tuple(rows.shape)}")
        with torch.no_grad():
            return self._encode(rows.detach().contiguous())

    def decode(self, encoded: EncodedRows) -> torch.Tensor:
        """Decodes rows encoded by this codec.

        Args:
            encoded: output of :meth:`encode` (possibly stored and rebuilt).

        Returns:
            float32 ``[N, D]``.

        Raises:
            EncodingFormatError: ``encoded`` was not written by a codec of this method
                and bit width, or its tensors do not match the layout.
        """
        self.check(encoded)
        with torch.no_grad():
            return self._decode(encoded)

    def decode_into(self, encoded: EncodedRows, out: torch.Tensor, rows: torch.Tensor, *,
                    accumulate: bool = False) -> None:
        """Decodes row ``r`` into ``out[rows[r]]``, in place; ``rows[r] < 0`` skips row ``r``.

        What a restore does with a checkpoint's rows: uniform codecs decode straight into
        ``out`` (no gather, no float32 temporary); the others decode the kept rows and
        copy them in. With ``accumulate`` each row is added onto its destination instead (a
        residual chain's restore): the decoded value, then one rounded add, whichever path.

        Args:
            encoded: output of :meth:`encode`.
            out: ``[M, D]``, any float dtype; its columns must be contiguous.
            rows: int64 ``[N]``, one destination row (or a negative skip) per encoded row.
            accumulate: add instead of write; the kept destinations must then be distinct.

        Raises:
            EncodingFormatError: as :meth:`decode`.
            ValueError: ``out`` or ``rows`` do not fit ``encoded``, or ``accumulate`` with a destination twice.
            IndexError: a destination is beyond ``out``'s rows; nothing is written then.
        """
        self.check(encoded)
        if out.dim() != 2 or out.shape[1] != encoded.dim or (out.shape[1] > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be [M, {encoded.dim}] with contiguous columns for these rows, got "
                             f"{tuple(out.shape)} with strides {out.stride()}")
        if rows.dim() != 1 or rows.dtype != torch.int64 or rows.numel() != encoded.num_rows:
            raise ValueError(f"rows must be int64 [{encoded.num_rows}], one per encoded row, got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        with torch.no_grad():
            self._decode_into(encoded, out, rows, accumulate)

    def view_decoded(self, encoded: EncodedRows) -> torch.Tensor | None:
        """The decoded rows as a view of ``encoded``'s payload, where decoding them is the identity (float32
        rows, ``none``): no copy, and writes to the view write the payload. None for every other codec."""
        self.check(encoded)
        return None

    def _decode_into(self, encoded: EncodedRows, out: torch.Tensor, rows: torch.Tensor, accumulate: bool) -> None:
        keep = (rows >= 0).nonzero().squeeze(1)
        dst = rows.index_select(0, keep)
        if dst.numel() and int(dst.max()) >= out.shape[0]:
            raise IndexError(f"rows reach row {int(dst.max())} of out, which has {out.shape[0]}")
        if accumulate and dst.unique().numel() != dst.numel():
            raise ValueError("accumulate=True needs distinct destination rows; sum the rows for one destination "
                             "first, or add them in two calls")
        vals = self._decode(encoded.take(keep))
        if accumulate:
            out.index_add_(0, dst.to(out.device), vals.to(device=out.device, dtype=out.dtype))
        elif out.device.type == "cpu" and out.dtype == vals.dtype:
            cnr_ops.scatter_rows_(out, dst, vals)
        else:
            out.index_copy_(0, dst.to(out.device), vals.to(device=out.device, dtype=out.dtype))

    def check(self, encoded: EncodedRows) -> None:
        """Checks that ``encoded`` has this codec's layout.

        Raises:
            EncodingFormatError: it does not.
        """
        if encoded.method != self.method or encoded.bits != self.bits:
            raise EncodingFormatError(
                f"rows encoded by {encoded.method!r} at {encoded.bits} bits cannot be decoded by {self!r}; "
                "use cnr_torchrec.quant.decode(encoded)"
            )
        expected = self.layout(encoded.num_rows, encoded.dim, encoded.params)
        for name in ("payload", "scale", "bias", "codebook"):
            t = getattr(encoded, name)
            want = expected.get(name)
            if want is None and t is None:
                continue
            if want is None or t is None or t.dtype != want[0] or tuple(t.shape) != want[1]:
                got = None if t is None else (t.dtype, tuple(t.shape))
                raise EncodingFormatError(f"{self!r}: tensor {name!r} should be {want}, got {got}")

    def row_error(self, diff: torch.Tensor) -> torch.Tensor:
        """Per row, the size of the errors ``diff`` (``[N, D]``, decoded minus original rows) by the measure this
        codec's grid keeps small: here the largest absolute error, which a grid over each row's [min, max]
        bounds by half a step; the codecs that fit their grid by least squares (``adaptive``, ``kmeans``)
        measure the sum of squared errors. 0 for rows of no columns."""
        return diff.abs().amax(1) if diff.shape[1] else torch.zeros(diff.shape[0])

    @abc.abstractmethod
    def bytes_per_row(self, dim: int) -> int:
        """Bytes written per row of ``dim`` values, parameters included."""

    @abc.abstractmethod
    def _encode(self, rows: torch.Tensor) -> EncodedRows: ...

    @abc.abstractmethod
    def _decode(self, encoded: EncodedRows) -> torch.Tensor: ...

    @abc.abstractmethod
    def layout(self, num_rows: int, dim: int, params: Mapping[str, Any]) -> Layout:
        """The tensors that ``num_rows`` rows of ``dim`` columns encode to with ``params`` (an encoding's
        own, as its metadata records them): ``{name: (dtype, shape)}``, absent ones left out."""

    def _validate(self) -> None:
        """Checks parameter combinations; raises UnknownCodecError."""

    def _encoded(self, params: Mapping[str, Any], dim: int, payload: torch.Tensor,
                 **tensors: torch.Tensor | None) -> EncodedRows:
        return EncodedRows(method=self.method, bits=self.bits, dim=dim, params=dict(params), payload=payload,
                           **tensors)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params.items())
        return f"{type(self).__name__}(method={self.method!r}, bits={self.bits}{', ' if args else ''}{args})"


def check_status(status: torch.Tensor) -> bool:
    """Reads a quantize kernel's per-row status: raises NonFiniteRowsError for rows flagged non-finite; returns
    whether any row overflowed."""
    if status.numel() == 0 or int(status.max()) == 0:
        return False
    bad = ((status & ops.STATUS_NON_FINITE) != 0).nonzero().flatten()
    if bad.numel():
        raise NonFiniteRowsError(bad.numel(), bad[:_MAX_REPORTED_ROWS].tolist())
    return True


def overflow_rows(status: torch.Tensor) -> tuple[int, list[int]]:
    """How many rows a kernel's status flags as overflowing, and the first few of them (for RowOverflowError)."""
    rows = ((status & ops.STATUS_OVERFLOW) != 0).nonzero().flatten()
    return rows.numel(), rows[:_MAX_REPORTED_ROWS].tolist()
