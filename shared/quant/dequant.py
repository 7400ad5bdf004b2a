"""Public dequantization entry point: raw GGUF tensor bytes -> float32 torch tensor.

Owns type dispatch, shape/byte-count validation and the error types. The per-format
math lives in ``float_types`` (F32/F16/BF16), ``legacy`` (Q4_0..Q8_0) and ``kquants``
(Q2_K..Q6_K); all of it is vectorized over every block at once and uses only torch ops
that exist on both CPU and CUDA, so the result is bit-identical to ``gguf.quants``
on either device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import float_types, kquants, legacy
from .blocks import as_blocks

__all__ = [
    "BLOCK_DEQUANTIZERS",
    "SUPPORTED_TYPES",
    "UnsupportedTensorType",
    "block_geometry",
    "dequantize",
]

T = GGMLQuantizationType

# (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32
BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: legacy.dequantize_q4_0,
    T.Q4_1: legacy.dequantize_q4_1,
    T.Q5_0: legacy.dequantize_q5_0,
    T.Q5_1: legacy.dequantize_q5_1,
    T.Q8_0: legacy.dequantize_q8_0,
    T.Q2_K: kquants.dequantize_q2_k,
    T.Q3_K: kquants.dequantize_q3_k,
    T.Q4_K: kquants.dequantize_q4_k,
    T.Q5_K: kquants.dequantize_q5_k,
    T.Q6_K: kquants.dequantize_q6_k,
}

# flat contiguous uint8 -> flat float32
_FLOAT_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: float_types.dequantize_f32,
    T.F16: float_types.dequantize_f16,
    T.BF16: float_types.dequantize_bf16,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    _FLOAT_DEQUANTIZERS.keys() | BLOCK_DEQUANTIZERS.keys()
)


class UnsupportedTensorType(ValueError):
    """Raised for a GGML tensor type this module cannot dequantize."""


def _resolve(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(int(qtype))
    except ValueError:
        raise UnsupportedTensorType(f"unknown GGML tensor type id {int(qtype)}") from None


def _supported(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    resolved = _resolve(qtype)
    if resolved not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedTensorType(
            f"GGML tensor type {resolved.name} ({int(resolved)}) is not supported "
            f"for dequantization; supported: {supported}"
        )
    return resolved


def block_geometry(qtype: int | GGMLQuantizationType) -> tuple[int, int]:
    """``(elements per block, bytes per block)`` for ``qtype``, from ``gguf.GGML_QUANT_SIZES``.

    Defined for every GGML type gguf knows, not only ``SUPPORTED_TYPES``, so callers can
    size buffers of tensors they will not dequantize here.
    """
    return GGML_QUANT_SIZES[_resolve(qtype)]


def _raw_bytes(data: torch.Tensor) -> torch.Tensor:
    # Callers normally hand over uint8, but GGUFReader exposes F32/F16 tensors with their
    # float dtype; accepting any dtype as its raw bytes saves them a view.
    flat = data.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.contiguous().view(torch.uint8)
    return flat.contiguous()


def dequantize(
    data: torch.Tensor, qtype: int | GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Dequantize raw GGUF tensor bytes to a float32 tensor of ``shape``.

    ``data`` holds the tensor's bytes exactly as stored in the file (uint8, flat or
    ``[rows, bytes_per_row]``). ``shape`` is the logical row-major shape (reversed GGUF
    ``ne``), its last dimension being the contiguous one that blocks run along. The
    result lives on ``data.device`` and is bit-identical to
    ``gguf.quants.dequantize(raw, qtype)``.

    Raises ``UnsupportedTensorType`` for types outside ``SUPPORTED_TYPES`` and
    ``ValueError`` when the byte count does not match ``shape``.
    """
    qt = _supported(qtype)
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qt]
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ValueError(
            f"{qt.name} rows must be a multiple of {block_size} elements, got shape {shape}"
        )
    n_elements = math.prod(shape)
    expected = n_elements // block_size * type_size
    raw = _raw_bytes(data)
    if raw.numel() != expected:
        raise ValueError(
            f"{qt.name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}"
        )

    if n_elements == 0:
        # Zero-size byte tensors have degenerate strides that refuse dtype views.
        return torch.empty(shape, dtype=torch.float32, device=data.device)
    float_fn = _FLOAT_DEQUANTIZERS.get(qt)
    if float_fn is not None:
        return float_fn(raw).reshape(shape)
    return BLOCK_DEQUANTIZERS[qt](as_blocks(raw, type_size)).reshape(shape)
