"""Per-row k-means quantization: codes index a codebook of centroids stored with each row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cnr_torchrec.quant import ops
from cnr_torchrec.quant.base import (
    PARAM_DTYPES,
    QUANT_BITS,
    Codec,
    Layout,
    Param,
    check_status,
    dtype_param,
    int_param,
    overflow_rows,
)
from cnr_torchrec.quant.encoded import EncodedRows
from cnr_torchrec.quant.errors import RowOverflowError
from cnr_torchrec.quant.uniform import AdaptiveCodec

__all__ = ["KMeansCodec"]


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
        "iters": int_param(10, 0, 1000),
        "init": Param("adaptive", lambda v: v in ("adaptive", "minmax"), "'adaptive' or 'minmax'"),
        "codebook_dtype": dtype_param("float16"),
    }

    def row_error(self, diff: torch.Tensor) -> torch.Tensor:
        """The sum of squared errors per row: what Lloyd's iterations minimize."""
        return diff.square().sum(1)

    def _centroids(self, dim: int) -> int:
        return min(1 << self.bits, dim)

    def bytes_per_row(self, dim: int) -> int:
        cb = PARAM_DTYPES[self._params["codebook_dtype"]].itemsize
        return ops.packed_bytes(dim, self.bits) + 4 + cb * (self._centroids(dim) - 1)

    def _encode(self, rows: torch.Tensor) -> EncodedRows:
        params = self._params
        grid: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
        if params["init"] == "adaptive" and rows.shape[1] > (1 << self.bits):
            p = AdaptiveCodec.param_specs
            grid = ops.adaptive_search(
                rows, self.bits, p["num_bins"].default, p["ratio"].default, p["refit_iters"].default
            )
        for attempt in range(2):
            payload, bias, codebook, status = ops.kmeans_quantize(
                rows, self.bits, params["iters"], PARAM_DTYPES[params["codebook_dtype"]], *grid
            )
            if not check_status(status):
                return self._encoded(params, rows.shape[1], payload=payload, bias=bias, codebook=codebook)
            if attempt == 0 and params["codebook_dtype"] != "float32":
                params = {**params, "codebook_dtype": "float32"}
        raise RowOverflowError(*overflow_rows(status), hint="their range exceeds float32; rescale the table")

    def _decode(self, encoded: EncodedRows) -> torch.Tensor:
        return ops.dequantize_codebook(encoded.payload, encoded.needed("bias"), encoded.needed("codebook"), self.bits,
                                       encoded.dim)

    def layout(self, num_rows: int, dim: int, params: Mapping[str, Any]) -> Layout:
        n, d = num_rows, dim
        return {
            "payload": (torch.uint8, (n, ops.packed_bytes(d, self.bits))),
            "bias": (torch.float32, (n,)),
            "codebook": (PARAM_DTYPES[params.get("codebook_dtype", "float16")], (n, self._centroids(d) - 1)),
        }
