"""GGUF tensor dequantization in torch, bit-identical to ``gguf.quants``.

``dequantize(data, qtype, shape)`` is the entry point used by the model's linear layers
while weights stay in GGUF block format on the device.
"""

from .blocks import FP16_FIELDS
from .dequant import (
    BLOCK_DEQUANTIZERS,
    SUPPORTED_TYPES,
    UnsupportedTensorType,
    block_geometry,
    dequantize,
)

__all__ = [
    "FP16_FIELDS",
    "BLOCK_DEQUANTIZERS",
    "SUPPORTED_TYPES",
    "UnsupportedTensorType",
    "block_geometry",
    "dequantize",
]
