"""Uniform rowwise quantization: symmetric, asymmetric (FBGEMM's layout) and adaptive (a searched grid)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from cnr_torchrec.quant import ops
from cnr_torchrec.quant.base import (
    _MAX_REPORTED_ROWS,
    PARAM_DTYPES,
    QUANT_BITS,
    Codec,
    Layout,
    Param,
    check_status,
    dtype_param,
    fraction_param,
    int_param,
    overflow_rows,
)
from cnr_torchrec.quant.encoded import EncodedRows
from cnr_torchrec.quant.errors import NonFiniteRowsError, RowOverflowError, UnknownCodecError

__all__ = ["UniformSymCodec", "UniformAsymCodec", "AdaptiveCodec"]


class _UniformCodec(Codec):
    """Uniform rowwise quantization: ``x ~ bias + scale * q`` (symmetric: ``scale * (q - qmax)``)."""

    symmetric: ClassVar[bool] = False

    def bytes_per_row(self, dim: int) -> int:
        n = ops.packed_bytes(dim, self.bits) + PARAM_DTYPES[self._params["scale_dtype"]].itemsize
        return n if self.symmetric else n + PARAM_DTYPES[self._params["bias_dtype"]].itemsize

    def _quantize(self, rows: torch.Tensor, params: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        return ops.quantize_uniform(
            rows,
            self.bits,
            symmetric=self.symmetric,
            scale_dtype=PARAM_DTYPES[params["scale_dtype"]],
            bias_dtype=PARAM_DTYPES[params.get("bias_dtype", "float32")],
        )

    def _encode(self, rows: torch.Tensor) -> EncodedRows:
        params = self._params
        for attempt in range(2):
            payload, scale, bias, status = self._quantize(rows, params)
            if not check_status(status):
                return self._encoded(params, rows.shape[1], payload=payload, scale=scale,
                                     bias=None if self.symmetric else bias)
            # A row's range does not fit the float16 parameters: this batch keeps float32 ones.
            if attempt == 0 and not self._all_float32(params):
                params = {**params, "scale_dtype": "float32", **({} if self.symmetric else {"bias_dtype": "float32"})}
        raise RowOverflowError(*overflow_rows(status), hint="their range exceeds float32; rescale the table")

    @staticmethod
    def _all_float32(params: Mapping[str, Any]) -> bool:
        return params["scale_dtype"] == "float32" and params.get("bias_dtype", "float32") == "float32"

    def _decode(self, encoded: EncodedRows) -> torch.Tensor:
        return ops.dequantize_uniform(encoded.payload, encoded.needed("scale"), encoded.bias, self.bits, encoded.dim)

    def _decode_into(self, encoded: EncodedRows, out: torch.Tensor, rows: torch.Tensor, accumulate: bool) -> None:
        if out.dtype != torch.float32:
            return super()._decode_into(encoded, out, rows, accumulate)
        # The encoded rows go to ``out``'s device and are decoded there (a CUDA table gets its 2-8-bit codes, not
        # 32-bit floats decoded on the host); nothing moves when they are on it already.
        device = out.device
        bias = None if encoded.bias is None else encoded.bias.to(device)
        ops.dequantize_uniform_into_(encoded.payload.to(device), encoded.needed("scale").to(device), bias, self.bits,
                                     rows.to(device), out, accumulate)

    def layout(self, num_rows: int, dim: int, params: Mapping[str, Any]) -> Layout:
        n, p = num_rows, params
        out = {
            "payload": (torch.uint8, (n, ops.packed_bytes(dim, self.bits))),
            "scale": (PARAM_DTYPES[p.get("scale_dtype", "float32")], (n,)),
        }
        if not self.symmetric:
            out["bias"] = (PARAM_DTYPES[p.get("bias_dtype", "float32")], (n,))
        return out


class UniformSymCodec(_UniformCodec):
    """Uniform symmetric: ``x ~ scale * (q - qmax)``, ``scale = max|x| / qmax``, ``qmax = 2**(bits-1) - 1``.

    The scale is kept in float32 by default: it is the only parameter, and float32
    lets a constant row (and any row whose magnitudes are all 0 or max|x|) decode exactly.
    """

    method = "uniform_sym"
    bit_choices = QUANT_BITS
    symmetric = True
    param_specs = {"scale_dtype": dtype_param("float32")}


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
        "scale_dtype": dtype_param("float16"),
        "bias_dtype": dtype_param("float32"),
        "backend": Param("cnr", lambda v: v in ("cnr", "fbgemm"), "'cnr' or 'fbgemm'"),
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
        "num_bins": int_param(25, 1, 1 << 16),
        "ratio": fraction_param(0.6),
        "refit_iters": int_param(3, 0, 64),
        "scale_dtype": dtype_param("float16"),
        "bias_dtype": dtype_param("float32"),
    }

    def row_error(self, diff: torch.Tensor) -> torch.Tensor:
        """The sum of squared errors per row: what the search and the refits minimize."""
        return diff.square().sum(1)

    def _quantize(self, rows: torch.Tensor, params: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        return ops.adaptive_quantize(
            rows,
            self.bits,
            params["num_bins"],
            float(params["ratio"]),
            params["refit_iters"],
            scale_dtype=PARAM_DTYPES[params["scale_dtype"]],
            bias_dtype=PARAM_DTYPES[params["bias_dtype"]],
        )


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
