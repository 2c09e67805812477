"""Row codecs for quantized checkpoints: one interface for every method.

``get_codec(method, bits, **params)`` returns a :class:`Codec`; ``codec.encode(rows)``
turns float32 rows ``[N, D]`` into :class:`EncodedRows` (a packed uint8 payload plus
per-row parameters, all plain tensors, with JSON-able metadata) and ``codec.decode``
turns them back. Methods: ``none``, ``fp16``, ``bf16``, ``uniform_sym``,
``uniform_asym``, ``kmeans``, ``adaptive``; the quantizing ones take 2, 3, 4 or 8 bits.
The kernels are ``torch.ops.cnr`` ops (see :mod:`cnr_torchrec.quant.ops`).
"""

from cnr_torchrec.quant.encoded import EncodedRows
from cnr_torchrec.quant.errors import (
    EncodingFormatError,
    InvalidRowsError,
    NonFiniteRowsError,
    RowOverflowError,
    UnknownCodecError,
)
from cnr_torchrec.quant.registry import (
    METHODS,
    QUANT_BITS,
    Codec,
    available_codecs,
    check_codec,
    codec_for,
    decode,
    get_codec,
    rebuild,
)

__all__ = [
    "METHODS",
    "QUANT_BITS",
    "Codec",
    "EncodedRows",
    "available_codecs",
    "check_codec",
    "codec_for",
    "decode",
    "get_codec",
    "rebuild",
    "EncodingFormatError",
    "InvalidRowsError",
    "NonFiniteRowsError",
    "RowOverflowError",
    "UnknownCodecError",
]
