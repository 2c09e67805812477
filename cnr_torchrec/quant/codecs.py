"""Row codecs: one interface over fp32 / fp16 / bf16 copies, uniform, adaptive and k-means quantization."""

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
    RowOverflowError,
    UnknownCodecError,
)

__all__ = ["Codec", "METHODS", "QUANT_BITS", "get_codec", "codec_for", "decode", "available_codecs"]

QUANT_BITS: tuple[int, ...] = (2, 3, 4, 8)
"""Bit widths of the quantizing methods."""

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""The tensors of an encoding: ``{name: (dtype, shape)}``."""

_DTYPES = {"float16": torch.float16, "float32": torch.float32}
_MAX_REPORTED_ROWS = 8


@dataclasses.dataclass(frozen=True)
class _Param:
    default: Any
    valid: Callable[[Any], bool]
    expect: str  # what a valid value looks like, for error messages


def _dtype_param(default: str) -> _Param:
    return _Param(default, lambda v: v in _DTYPES, "'float16' or 'float32'")


def _int_param(default: int, lo: int, hi: int) -> _Param:
    def valid(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    return _Param(default, valid, f"an int in [{lo}, {hi}]")


def _fraction_param(default: float) -> _Param:
    def valid(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1

    return _Param(default, valid, "a number in (0, 1]")


class Codec(abc.ABC):
    """Encodes float32 rows ``[N, D]`` into :class:`EncodedRows` and back.

    Call order:
        0. ``codec = get_codec(method, bits, **params)``;
        1. ``encoded = codec.encode(rows)``: rows are float32 ``[N, D]``, N may be 0;
        2. store ``encoded.to_tensors()`` and ``encoded.metadata()`` (no pickle needed);
        3. ``encoded = EncodedRows.from_tensors(tensors, metadata)``;
        4. ``rows_hat = codec.decode(encoded)``, or ``cnr_torchrec.quant.decode(encoded)``,
           which rebuilds the codec from the metadata.

    Encoding is deterministic: the same rows give the same bytes whatever the thread
    count. Subclasses implement ``_encode``, ``_decode``, ``layout`` and ``bytes_per_row``.
    """

    method: ClassVar[str]
    bit_choices: ClassVar[tuple[int, ...]]
    param_specs: ClassVar[dict[str, _Param]] = {}

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

    def decode_into(self, encoded: EncodedRows, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Decodes row ``r`` into ``out[rows[r]]``, in place; ``rows[r] < 0`` skips row ``r``.

        What a restore does with a checkpoint's rows: uniform codecs decode straight into
        ``out`` (no gather, no float32 temporary); the others decode the kept rows and
        copy them in.

        Args:
            encoded: output of :meth:`encode`.
            out: ``[M, D]``, any float dtype; its columns must be contiguous.
            rows: int64 ``[N]``, one destination row (or a negative skip) per encoded row.

        Raises:
            EncodingFormatError: as :meth:`decode`.
            ValueError: ``out`` or ``rows`` do not fit ``encoded``.
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
            self._decode_into(encoded, out, rows)

    def _decode_into(self, encoded: EncodedRows, out: torch.Tensor, rows: torch.Tensor) -> None:
        keep = (rows >= 0).nonzero().squeeze(1)
        dst = rows.index_select(0, keep)
        if dst.numel() and int(dst.max()) >= out.shape[0]:
            raise IndexError(f"rows reach row {int(dst.max())} of out, which has {out.shape[0]}")
        vals = self._decode(encoded.take(keep))
        if out.device.type == "cpu" and out.dtype == vals.dtype:
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

    def _encoded(self, params: Mapping[str, Any], dim: int, **tensors: torch.Tensor | None) -> EncodedRows:
        return EncodedRows(method=self.method, bits=self.bits, dim=dim, params=dict(params), **tensors)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params.items())
        return f"{type(self).__name__}(method={self.method!r}, bits={self.bits}{', ' if args else ''}{args})"


def _check_status(status: torch.Tensor) -> bool:
    """Raises NonFiniteRowsError for rows flagged non-finite; returns whether any row overflowed."""
    if status.numel() == 0 or int(status.max()) == 0:
        return False
    bad = ((status & ops.STATUS_NON_FINITE) != 0).nonzero().flatten()
    if bad.numel():
        raise NonFiniteRowsError(bad.numel(), bad[:_MAX_REPORTED_ROWS].tolist())
    return True


def _overflow_rows(status: torch.Tensor) -> tuple[int, list[int]]:
    rows = ((status & ops.STATUS_OVERFLOW) != 0).nonzero().flatten()
    return rows.numel(), rows[:_MAX_REPORTED_ROWS].tolist()


class _FloatCodec(Codec):
    """Rows as float32, float16 or bfloat16 values."""

    dtype: ClassVar[torch.dtype]

    def bytes_per_row(self, dim: int) -> int:
        return dim * self.dtype.itemsize

    def _encode(self, rows: torch.Tensor) -> EncodedRows:
        payload, status = ops.cast_rows(rows, self.dtype)
        if _check_status(status):
            limit = torch.finfo(self.dtype).max
            hint = f"{self.method} holds at most ±{limit:g}; use bf16 or none"
            raise RowOverflowError(*_overflow_rows(status), hint=hint)
        return self._encoded(self._params, rows.shape[1], payload=payload)

    def _decode(self, encoded: EncodedRows) -> torch.Tensor:
        values = encoded.payload.view(self.dtype).view(encoded.num_rows, encoded.dim)
        # A copy even for float32: decoded rows must not alias the stored payload.
        return values.to(torch.float32, copy=True)

    def layout(self, num_rows: int, dim: int, params: Mapping[str, Any]) -> Layout:
        return {"payload": (torch.uint8, (num_rows, self.bytes_per_row(dim)))}


class NoneCodec(_FloatCodec):
    """Full precision: the float32 bytes, checked for NaN and Inf."""

    method = "none"
    bit_choices = (32,)
    dtype = torch.float32


class Fp16Codec(_FloatCodec):
    """IEEE half precision (round to nearest even); values beyond ±65504 are an error."""

    method = "fp16"
    bit_choices = (16,)
    dtype = torch.float16


class Bf16Codec(_FloatCodec):
    """bfloat16 (round to nearest even): float32's range at 8 bits of mantissa."""

    method = "bf16"
    bit_choices = (16,)
    dtype = torch.bfloat16


class _UniformCodec(Codec):
    """Uniform rowwise quantization: ``x ~ bias + scale * q`` (symmetric: ``scale * (q - qmax)``)."""

    symmetric: ClassVar[bool] = False

    def bytes_per_row(self, dim: int) -> int:
        n = ops.packed_bytes(dim, self.bits) + _DTYPES[self._params["scale_dtype"]].itemsize
        return n if self.symmetric else n + _DTYPES[self._params["bias_dtype"]].itemsize

    def _quantize(self, rows: torch.Tensor, params: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        return ops.quantize_uniform(
            rows,
            self.bits,
            symmetric=self.symmetric,
            scale_dtype=_DTYPES[params["scale_dtype"]],
            bias_dtype=_DTYPES[params.get("bias_dtype", "float32")],
        )

    def _encode(self, rows: torch.Tensor) -> EncodedRows:
        params = self._params
        for attempt in range(2):
            payload, scale, bias, status = self._quantize(rows, params)
            if not _check_status(status):
                bias = None if self.symmetric else bias
                return self._encoded(params, rows.shape[1], payload=payload, scale=scale, bias=bias)
            # A row's range does not fit the float16 parameters: this batch keeps float32 ones.
            if attempt == 0 and not self._all_float32(params):
                params = {**params, "scale_dtype": "float32", **({} if self.symmetric else {"bias_dtype": "float32"})}
        raise RowOverflowError(*_overflow_rows(status), hint="their range exceeds float32; rescale the table")

    @staticmethod
    def _all_float32(params: Mapping[str, Any]) -> bool:
        return params["scale_dtype"] == "float32" and params.get("bias_dtype", "float32") == "float32"

    def _decode(self, encoded: EncodedRows) -> torch.Tensor:
        return ops.dequantize_uniform(encoded.payload, encoded.scale, encoded.bias, self.bits, encoded.dim)

    def _decode_into(self, encoded: EncodedRows, out: torch.Tensor, rows: torch.Tensor) -> None:
        if out.dtype != torch.float32:
            return super()._decode_into(encoded, out, rows)
        ops.dequantize_uniform_into_(encoded.payload, encoded.scale, encoded.bias, self.bits, rows, out)

    def layout(self, num_rows: int, dim: int, params: Mapping[str, Any]) -> Layout:
        n, p = num_rows, params
        out = {
            "payload": (torch.uint8, (n, ops.packed_bytes(dim, self.bits))),
            "scale": (_DTYPES[p.get("scale_dtype", "float32")], (n,)),
        }
        if not self.symmetric:
            out["bias"] = (_DTYPES[p.get("bias_dtype", "float32")], (n,))
        return out


class UniformSymCodec(_UniformCodec):
    """Uniform symmetric: ``x ~ scale * (q - qmax)``, ``scale = max|x| / qmax``, ``qmax = 2**(bits-1) - 1``.

    The scale is kept in float32 by default: it is the only parameter, and float32
    lets a constant row (and any row whose magnitudes are all 0 or max|x|) decode exactly.
    """

    method = "uniform_sym"
    bit_choices = QUANT_BITS
    symmetric = True
    param_specs = {"scale_dtype": _dtype_param("float32")}


class UniformAsymCodec(_UniformCodec):
    """Uniform asymmetric on [min, max]: ``x ~ bias + scale * q``, q in [0, 2**bits - 1].

    The default layout (float16 scale, float32 bias) is ours: a float32 bias decodes
    constant rows exactly. ``backend='fbgemm'`` encodes with FBGEMM's rowwise ops where
    they produce the chosen layout: float16 scale and bias at 2, 4 and 8 bits when the
    packed row has an even number of bytes (``FloatToFusedNBitRowwiseQuantizedSBHalf``),
    float32 scale and bias at 8 bits (``FloatToFused8BitRowwiseQuantized``). The bytes
    differ slightly (FBGEMM rounds the parameters to nearest, we round the scale up and
    the bias down) but the layout is the same, and one decoder reads both. The default
    backend is ours: FBGEMM's ops do not check for NaN, and checking costs them a pass
    that leaves them slower than our one-pass kernels (see docs/codecs.md).
    """

    method = "uniform_asym"
    bit_choices = QUANT_BITS
    param_specs = {
        "scale_dtype": _dtype_param("float16"),
        "bias_dtype": _dtype_param("float32"),
        "backend": _Param("cnr", lambda v: v in ("cnr", "fbgemm"), "'cnr' or 'fbgemm'"),
    }

    def _fbgemm_kind(self, dim: int | None) -> str | None:
        """The FBGEMM op that produces this layout for rows of ``dim`` values (None: any D), or None."""
        p = self._params
        if p["backend"] != "fbgemm" or not _fbgemm_available():
            return None
        if p["scale_dtype"] == p["bias_dtype"] == "float16" and self.bits in (2, 4, 8):
            # FBGEMM's NBit op wants the packed row to hold whole float16 words.
            return "nbit" if dim is None or (dim * self.bits) % 16 == 0 else None
        if p["scale_dtype"] == p["bias_dtype"] == "float32" and self.bits == 8:
            return "8bit"
        return None

    def _validate(self) -> None:
        if self._params["backend"] == "fbgemm" and self._fbgemm_kind(None) is None:
            raise UnknownCodecError(
                "backend='fbgemm' needs a layout FBGEMM's rowwise ops produce: scale_dtype = bias_dtype = 'float16' "
                "at 2, 4 or 8 bits, or both 'float32' at 8 bits (and fbgemm_gpu installed)"
            )

    def _encode(self, rows: torch.Tensor) -> EncodedRows:
        kind = self._fbgemm_kind(rows.shape[1])
        if kind is None and self._params["backend"] == "fbgemm":
            raise UnknownCodecError(
                f"backend='fbgemm': FBGEMM's {self.bits}-bit op needs D * bits to be a multiple of 16, got D = "
                f"{rows.shape[1]}; use backend='cnr'"
            )
        if kind is not None and rows.shape[0] > 0:
            encoded = self._encode_fbgemm(rows, kind)
            if encoded is not None:
                return encoded
        return super()._encode(rows)  # also FBGEMM's fallback: it promotes parameters that overflow

    def _encode_fbgemm(self, rows: torch.Tensor, kind: str) -> EncodedRows | None:
        # FBGEMM does not check its input (a NaN silently becomes a code), so check it:
        # a row sum is non-finite whenever the row is, and rarely otherwise.
        suspects = (~torch.isfinite(rows.sum(dim=1))).nonzero().flatten()
        if suspects.numel():
            bad = suspects[~torch.isfinite(rows[suspects]).all(dim=1)]
            if bad.numel():
                raise NonFiniteRowsError(bad.numel(), bad[:_MAX_REPORTED_ROWS].tolist())
        dim = rows.shape[1]
        if kind == "nbit":
            fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(rows, self.bits)
            nb, pdtype = ops.packed_bytes(dim, self.bits), torch.float16
        else:
            fused = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(rows)
            nb, pdtype = dim, torch.float32
        scale_bias = fused[:, nb:].contiguous().view(pdtype)
        if not bool(torch.isfinite(scale_bias).all()):
            return None  # float16 parameters overflowed: our kernel promotes them
        return self._encoded(
            self._params,
            dim,
            payload=fused[:, :nb].contiguous(),
            scale=scale_bias[:, 0].contiguous(),
            bias=scale_bias[:, 1].contiguous(),
        )


class AdaptiveCodec(_UniformCodec):
    """Asymmetric quantization on a per-row clipping range chosen by Check-N-Run's greedy search.

    Starts at [min, max] with ``step = (max - min) / num_bins``; each round tries moving
    min up or max down one step, keeps the move with the lower squared error and
    remembers the best range, until the range falls below ``ratio * (max - min)``. Then
    ``refit_iters`` least-squares refits of (bias, scale) to the best grid's codes, each
    of which can only lower the error (0 gives the paper's algorithm as is).
    """

    method = "adaptive"
    bit_choices = QUANT_BITS
    param_specs = {
        "num_bins": _int_param(25, 1, 1 << 16),
        "ratio": _fraction_param(0.6),
        "refit_iters": _int_param(3, 0, 64),
        "scale_dtype": _dtype_param("float16"),
        "bias_dtype": _dtype_param("float32"),
    }

    def _quantize(self, rows: torch.Tensor, params: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        return ops.adaptive_quantize(
            rows,
            self.bits,
            params["num_bins"],
            float(params["ratio"]),
            params["refit_iters"],
            scale_dtype=_DTYPES[params["scale_dtype"]],
            bias_dtype=_DTYPES[params["bias_dtype"]],
        )


class KMeansCodec(Codec):
    """Per-row k-means: ``K = min(2**bits, D)`` centroids, codes index them.

    Lloyd's algorithm runs ``iters`` iterations from a deterministic start: the grid of
    the adaptive codec (``init='adaptive'``, its default parameters) or the uniform grid
    over [min, max] (``init='minmax'``). Nearest-centroid codes on a uniform grid are
    that grid's uniform quantization and no Lloyd step raises the error, so k-means
    ends at least as accurate as its start. Stored per row: the smallest centroid in
    float32 (``bias``) and the other K - 1 as offsets from it (``codebook``).
    """

    method = "kmeans"
    bit_choices = QUANT_BITS
    param_specs = {
        "iters": _int_param(10, 0, 1000),
        "init": _Param("adaptive", lambda v: v in ("adaptive", "minmax"), "'adaptive' or 'minmax'"),
        "codebook_dtype": _dtype_param("float16"),
    }

    def _centroids(self, dim: int) -> int:
        return min(1 << self.bits, dim)

    def bytes_per_row(self, dim: int) -> int:
        cb = _DTYPES[self._params["codebook_dtype"]].itemsize
        return ops.packed_bytes(dim, self.bits) + 4 + cb * (self._centroids(dim) - 1)

    def _encode(self, rows: torch.Tensor) -> EncodedRows:
        params = self._params
        grid = (None, None)
        if params["init"] == "adaptive" and rows.shape[1] > (1 << self.bits):
            p = AdaptiveCodec.param_specs
            grid = ops.adaptive_search(
                rows, self.bits, p["num_bins"].default, p["ratio"].default, p["refit_iters"].default
            )
        for attempt in range(2):
            payload, bias, codebook, status = ops.kmeans_quantize(
                rows, self.bits, params["iters"], _DTYPES[params["codebook_dtype"]], *grid
            )
            if not _check_status(status):
                return self._encoded(params, rows.shape[1], payload=payload, bias=bias, codebook=codebook)
            if attempt == 0 and params["codebook_dtype"] != "float32":
                params = {**params, "codebook_dtype": "float32"}
        raise RowOverflowError(*_overflow_rows(status), hint="their range exceeds float32; rescale the table")

    def _decode(self, encoded: EncodedRows) -> torch.Tensor:
        return ops.dequantize_codebook(encoded.payload, encoded.bias, encoded.codebook, self.bits, encoded.dim)

    def layout(self, num_rows: int, dim: int, params: Mapping[str, Any]) -> Layout:
        n, d = num_rows, dim
        return {
            "payload": (torch.uint8, (n, ops.packed_bytes(d, self.bits))),
            "bias": (torch.float32, (n,)),
            "codebook": (_DTYPES[params.get("codebook_dtype", "float16")], (n, self._centroids(d) - 1)),
        }


_REGISTRY: dict[str, type[Codec]] = {
    cls.method: cls
    for cls in (NoneCodec, Fp16Codec, Bf16Codec, UniformSymCodec, UniformAsymCodec, KMeansCodec, AdaptiveCodec)
}
METHODS: tuple[str, ...] = tuple(_REGISTRY)
"""Every codec method."""


def available_codecs() -> dict[str, tuple[int, ...]]:
    """Each method with the bit widths it accepts."""
    return {m: cls.bit_choices for m, cls in _REGISTRY.items()}


def get_codec(method: str, bits: int | None = None, **params: Any) -> Codec:
    """Returns the codec for ``method`` at ``bits``.

    Args:
        method: one of ``METHODS``: none, fp16, bf16, uniform_sym, uniform_asym, kmeans, adaptive.
        bits: 2, 3, 4 or 8 for the quantizing methods; for none / fp16 / bf16 it may be
            omitted or given as their width (32 / 16).
        **params: method parameters (see each codec's ``param_specs``), e.g. ``num_bins``
            and ``ratio`` for adaptive, ``iters`` for kmeans, ``scale_dtype``.

    Returns:
        The codec.

    Raises:
        UnknownCodecError: unknown method, unsupported bits, or an unknown or invalid
            parameter; the message lists the valid choices.
    """
    cls = _REGISTRY.get(method)
    if cls is None:
        raise UnknownCodecError(f"unknown codec method {method!r}; valid methods: {', '.join(METHODS)}")
    if bits is None and len(cls.bit_choices) == 1:
        bits = cls.bit_choices[0]
    if bits not in cls.bit_choices or isinstance(bits, bool):
        choices = ", ".join(map(str, cls.bit_choices))
        raise UnknownCodecError(f"codec {method!r} does not support bits={bits!r}; valid bits: {choices}")
    return cls(bits, params)


def codec_for(encoded: EncodedRows) -> Codec:
    """The codec that decodes ``encoded``, rebuilt from its metadata.

    Raises:
        EncodingFormatError: the metadata names no valid codec.
    """
    try:
        return get_codec(encoded.method, encoded.bits, **encoded.params)
    except UnknownCodecError as e:
        raise EncodingFormatError(f"encoded rows name no valid codec: {e}") from e


def decode(encoded: EncodedRows) -> torch.Tensor:
    """Decodes rows with the codec their metadata names.

    Raises:
        EncodingFormatError: the metadata or tensors are inconsistent.
    """
    return codec_for(encoded).decode(encoded)


_fbgemm_ok: bool | None = None


def _fbgemm_available() -> bool:
    global _fbgemm_ok
    if _fbgemm_ok is None:
        try:
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

            _fbgemm_ok = hasattr(torch.ops.fbgemm, "FloatToFusedNBitRowwiseQuantizedSBHalf")
        except ImportError:
            _fbgemm_ok = False
    return _fbgemm_ok
