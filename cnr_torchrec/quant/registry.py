"""The codec registry: every method by name, and how to get the codec of a method or of encoded rows.

Each family is a module of its own (:mod:`~cnr_torchrec.quant.floats`, :mod:`~cnr_torchrec.quant.uniform`,
:mod:`~cnr_torchrec.quant.kmeans`) behind the interface of :mod:`~cnr_torchrec.quant.base`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cnr_torchrec.quant.base import QUANT_BITS, Codec
from cnr_torchrec.quant.encoded import EncodedRows
from cnr_torchrec.quant.errors import EncodingFormatError, UnknownCodecError
from cnr_torchrec.quant.floats import Bf16Codec, Fp16Codec, NoneCodec
from cnr_torchrec.quant.kmeans import KMeansCodec
from cnr_torchrec.quant.uniform import AdaptiveCodec, UniformAsymCodec, UniformSymCodec

__all__ = ["Codec", "METHODS", "QUANT_BITS", "get_codec", "check_codec", "codec_for", "decode", "available_codecs"]


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


def check_codec(method: str, bits: int | None = None, **params: Any) -> None:
    """Whether :func:`get_codec` takes these arguments, for a config's check: the codec it would build is not kept.

    Raises:
        UnknownCodecError: as :func:`get_codec` does.
    """
    get_codec(method, bits, **params)


def codec_for(encoded: EncodedRows) -> Codec:
    """The codec that decodes ``encoded``, rebuilt from its metadata.

    Raises:
        EncodingFormatError: the metadata names no valid codec.
    """
    try:
        return get_codec(encoded.method, encoded.bits, **encoded.params)
    except UnknownCodecError as e:
        raise EncodingFormatError(f"encoded rows name no valid codec: {e}") from e


def rebuild(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> EncodedRows:
    """Encoded rows from stored ``to_tensors()`` and ``metadata()``, checked against the layout of the codec
    the metadata names (:meth:`EncodedRows.from_tensors` checks their structure alone).

    Raises:
        EncodingFormatError: the metadata is not ours, names a newer version or no valid codec, or a tensor is
            missing, unexpected, or of another shape or dtype than the codec writes.
    """
    encoded = EncodedRows.from_tensors(tensors, metadata)
    codec_for(encoded).check(encoded)
    return encoded


def decode(encoded: EncodedRows) -> torch.Tensor:
    """Decodes rows with the codec their metadata names.

    Raises:
        EncodingFormatError: the metadata or tensors are inconsistent.
    """
    return codec_for(encoded).decode(encoded)
