"""``EncodedRows``: what a codec writes, as plain tensors plus JSON-able metadata."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from cnr_torchrec.quant.errors import EncodingFormatError

__all__ = ["EncodedRows"]

_TENSOR_FIELDS = ("payload", "scale", "bias", "codebook")


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedRows:
    """Rows encoded by one codec: a packed uint8 payload plus per-row parameters.

    Everything is a plain tensor or a JSON-able value, so a checkpointer can store it
    without pickling: ``to_tensors()`` gives the tensors, ``metadata()`` the rest, and
    ``from_tensors(tensors, metadata)`` rebuilds it (checking that the two agree;
    ``cnr_torchrec.quant.rebuild`` also checks them against the codec's layout).
    Decode with the codec that wrote it, or with ``cnr_torchrec.quant.decode``.

    Attributes:
        method: codec method (``"adaptive"``, ``"fp16"``, ...).
        bits: bits per value (32 for ``none``, 16 for ``fp16``/``bf16``).
        dim: values per row (D).
        params: the codec's parameters, JSON-able, as used for this batch.
        payload: uint8 ``[N, bytes_per_row]``, the packed codes (or raw float bytes).
        scale: per-row scale ``[N]`` (uniform codecs), else None.
        bias: per-row bias ``[N]`` (asymmetric codecs; k-means: the smallest centroid), else None.
        codebook: ``[N, K - 1]`` centroid offsets from ``bias`` (k-means), else None.
    """

    method: str
    bits: int
    dim: int
    params: Mapping[str, Any]
    payload: torch.Tensor
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    codebook: torch.Tensor | None = None

    FORMAT: ClassVar[str] = "cnr_torchrec.quant.EncodedRows"
    VERSION: ClassVar[int] = 1

    def needed(self, name: str) -> torch.Tensor:
        """Parameter tensor ``name`` (``scale``, ``bias`` or ``codebook``), which the codec that decodes these rows
        needs; raises EncodingFormatError where they carry none."""
        t = getattr(self, name)
        if t is None:
            raise EncodingFormatError(f"{self.method} rows carry no {name}, which their codec needs to decode them")
        return t

    def with_tensors(self, tensors: Mapping[str, torch.Tensor]) -> EncodedRows:
        """These rows with ``tensors`` (named as :meth:`to_tensors` names them) in place of their own."""
        fields: dict[str, Any] = dict(tensors)
        return dataclasses.replace(self, **fields)

    def take(self, rows: torch.Tensor) -> EncodedRows:
        """The rows ``rows`` (int64 positions) of these, still encoded (every tensor holds one entry per row)."""
        if rows.numel() == self.num_rows and bool((rows == torch.arange(rows.numel())).all()):
            return self
        return self.with_tensors({k: v.index_select(0, rows) for k, v in self.to_tensors().items()})

    def __post_init__(self) -> None:
        if not isinstance(self.payload, torch.Tensor) or self.payload.dtype != torch.uint8 or self.payload.dim() != 2:
            raise EncodingFormatError(f"payload must be a 2-D uint8 tensor, got {_describe(self.payload)}")
        n = self.payload.shape[0]
        for name in ("scale", "bias", "codebook"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
                raise EncodingFormatError(f"{name} must be a tensor with one entry per row ({n}), got {_describe(t)}")
        if self.dim < 1 or self.bits < 1:
            raise EncodingFormatError(f"dim and bits must be positive, got dim={self.dim}, bits={self.bits}")
        try:
            json.dumps(dict(self.params))
        except (TypeError, ValueError) as e:
            raise EncodingFormatError(f"params must be JSON-able: {e}") from e

    @property
    def num_rows(self) -> int:
        """Number of encoded rows (N)."""
        return self.payload.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a checkpoint writes for these rows: payload plus per-row parameters."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    @property
    def device(self) -> torch.device:
        """Device of the tensors."""
        return self.payload.device

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to store, by name; absent parameters are left out."""
        return {name: getattr(self, name) for name in _TENSOR_FIELDS if getattr(self, name) is not None}

    def metadata(self) -> dict[str, Any]:
        """JSON-able description that, with ``to_tensors()``, rebuilds these rows."""
        return {
            "format": self.FORMAT,
            "version": self.VERSION,
            "method": self.method,
            "bits": self.bits,
            "dim": self.dim,
            "num_rows": self.num_rows,
            "params": dict(self.params),
        }

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> EncodedRows:
        """Rebuilds encoded rows from ``to_tensors()`` and ``metadata()`` output, checking their structure: the
        metadata's format, version and keys, the tensors' names, one entry per row, the row count. Rows read from
        storage go through ``cnr_torchrec.quant.rebuild``, which also checks every tensor's shape and dtype
        against the layout of the codec the metadata names.

        Args:
            tensors: the stored tensors by name.
            metadata: the stored metadata.

        Raises:
            EncodingFormatError: the metadata is not ours or names a newer version, a tensor is missing or
                unexpected, or the row counts disagree.
        """
        if metadata.get("format") != cls.FORMAT:
            raise EncodingFormatError(f"metadata format is {metadata.get('format')!r}, expected {cls.FORMAT!r}")
        if metadata.get("version") != cls.VERSION:
            raise EncodingFormatError(
                f"encoded rows have format version {metadata.get('version')!r}; this build reads version "
                f"{cls.VERSION}. Upgrade cnr_torchrec to read them."
            )
        missing = {"method", "bits", "dim", "num_rows", "params"} - metadata.keys()
        if missing:
            raise EncodingFormatError(f"metadata lacks {sorted(missing)}")
        unknown = set(tensors) - set(_TENSOR_FIELDS)
        if unknown or "payload" not in tensors:
            raise EncodingFormatError(
                f"expected tensors among {list(_TENSOR_FIELDS)} including 'payload', got {sorted(tensors)}"
            )
        encoded = cls(
            method=metadata["method"],
            bits=int(metadata["bits"]),
            dim=int(metadata["dim"]),
            params=dict(metadata["params"]),
            **{name: tensors[name] for name in tensors},
        )
        if encoded.num_rows != metadata["num_rows"]:
            raise EncodingFormatError(
                f"metadata says {metadata['num_rows']} rows, the payload holds {encoded.num_rows}"
            )
        return encoded

    def to(self, device: torch.device | str) -> EncodedRows:
        """A copy whose tensors are on ``device``."""
        return self.with_tensors({k: v.to(device) for k, v in self.to_tensors().items()})


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)}"
    return type(t).__name__
