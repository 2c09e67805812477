"""Full-width copies of rows: float32 (``none``), float16 and bfloat16."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from cnr_torchrec import ops as cnr_ops
from cnr_torchrec.quant import ops
from cnr_torchrec.quant.base import Codec, Layout, check_status, overflow_rows
from cnr_torchrec.quant.encoded import EncodedRows
from cnr_torchrec.quant.errors import RowOverflowError

__all__ = ["NoneCodec", "Fp16Codec", "Bf16Codec"]


class _FloatCodec(Codec):
    """Rows as float32, float16 or bfloat16 values."""

    dtype: ClassVar[torch.dtype]

    def bytes_per_row(self, dim: int) -> int:
        return dim * self.dtype.itemsize

    def _encode(self, rows: torch.Tensor) -> EncodedRows:
        payload, status = ops.cast_rows(rows, self.dtype)
        if check_status(status):
            limit = torch.finfo(self.dtype).max
            hint = f"{self.method} holds at most ±{limit:g}; use bf16 or none"
            raise RowOverflowError(*overflow_rows(status), hint=hint)
        return self._encoded(self._params, rows.shape[1], payload=payload)

    def _decode(self, encoded: EncodedRows) -> torch.Tensor:
        # A copy even for float32: decoded rows must not alias the stored payload.
        return self._values(encoded).to(torch.float32, copy=True)

    def _decode_into(self, encoded: EncodedRows, out: torch.Tensor, rows: torch.Tensor, accumulate: bool) -> None:
        values = self._values(encoded)
        if accumulate or out.device.type != "cpu" or out.dtype != values.dtype:
            return super()._decode_into(encoded, out, rows, accumulate)
        n = rows.numel()
        first = int(rows[0]) if n else 0
        if n and 0 <= first and first + n <= out.shape[0] and torch.equal(rows, torch.arange(first, first + n)):
            out[first : first + n].copy_(values)  # one run of rows, in order: one plain copy
        else:
            cnr_ops.scatter_rows_(out, rows, values)  # the stored values are the rows: copied once, from where they lie

    def view_decoded(self, encoded: EncodedRows) -> torch.Tensor | None:
        self.check(encoded)
        return self._values(encoded) if self.dtype == torch.float32 else None

    def _values(self, encoded: EncodedRows) -> torch.Tensor:
        return encoded.payload.view(self.dtype).view(encoded.num_rows, encoded.dim)

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
