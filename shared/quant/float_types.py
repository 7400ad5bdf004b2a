"""Unquantized GGUF tensor types: F32, F16 and BF16 reinterpreted as float32.

These are plain bit reinterpretations, matching ``gguf.quants.dequantize``: F32 is a view,
F16 is an IEEE half -> single conversion (exact for every finite value), and BF16 is the
upper half of a float32 so it is widened with an integer shift rather than a float cast.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_bf16", "dequantize_f16", "dequantize_f32"]


def _view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Tensor.view(dtype) refuses a storage offset that is not a multiple of the wider
    # item size, which a slice of a larger (e.g. mmapped) byte buffer can have.
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


def dequantize_f32(raw: torch.Tensor) -> torch.Tensor:
    """Raw little-endian bytes (uint8, contiguous) -> flat float32."""
    return _view(raw, torch.float32)


def dequantize_f16(raw: torch.Tensor) -> torch.Tensor:
    """Raw little-endian bytes (uint8, contiguous) -> flat float32 via IEEE half."""
    return _view(raw, torch.float16).to(torch.float32)


def dequantize_bf16(raw: torch.Tensor) -> torch.Tensor:
    """Raw little-endian bytes (uint8, contiguous) -> flat float32 via bfloat16.

    gguf does ``int16 -> int32 << 16`` and reinterprets; doing the same in integers keeps
    NaN payloads bit-identical, which a float conversion is not obliged to do.
    """
    widened = _view(raw, torch.int16).to(torch.int32) << 16
    return widened.view(torch.float32)
