"""Legacy 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.

Each function takes ``(n_blocks, type_size)`` uint8 blocks and returns
``(n_blocks, 32)`` float32, reproducing ``gguf.quants`` operation by operation:
the fp16 scale ``d`` (and min ``m``) are widened to float32 first, the integer quant is
exact in float32, and then ``d * q`` (``+ m`` as a separate add) is evaluated in float32.
``d * q`` is always exact (11-bit significand times a quant of at most 8 bits), so the
``+ m`` is the only rounding step.

The integer quant tensor is handed to the multiply as is: torch promotes it to float32
exactly inside the kernel, which saves a full conversion pass over the output size.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from .blocks import fp16_field, int8_field, shift_table, unpack_bits

__all__ = [
    "LAYOUT",
    "dequantize_q4_0",
    "dequantize_q4_1",
    "dequantize_q5_0",
    "dequantize_q5_1",
    "dequantize_q8_0",
    "fifth_bits",
]

# Byte offsets inside a block, from ggml's structs: (m, qh, qs, quant bias); -1 = no such field.
# d (fp16) is always at byte 0.
LAYOUT: dict[T, tuple[int, int, int, int]] = {
    T.Q4_0: (-1, -1, 2, 8),
    T.Q4_1: (2, -1, 4, 0),
    T.Q5_0: (-1, 2, 6, 16),
    T.Q5_1: (2, 4, 8, 0),
    T.Q8_0: (-1, -1, 2, 0),
}


def _low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    # Elements 0..15 sit in the low nibbles and 16..31 in the high nibbles of the same
    # 16 bytes, i.e. one 16-byte chunk unpacked in two 4-bit runs.
    return unpack_bits(qs, 4, 16)


def fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """qh bytes [n, 4] -> uint8 [n, 32]: the fifth bit of each element of a Q5_0/Q5_1 block."""
    # gguf reads qh as one little-endian uint32 and takes bit i for element i. Bit i of
    # that word is bit (i % 8) of byte (i // 8), which keeps the work in uint8 (uint32
    # shifts are not available on CUDA).
    n_blocks = qh.shape[0]
    shifts = shift_table(tuple(range(8)), 3, 2, qh.device)
    return ((qh.reshape(n_blocks, 4, 1) >> shifts) & 1).reshape(n_blocks, 32)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0: ``d * (q - 8)``; layout ``d:f16 | qs[16]``."""
    d = fp16_field(blocks, 0)
    q = _low_high_nibbles(blocks[:, 2:18]).view(torch.int8) - 8
    return d * q


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1: ``d * q + m``; layout ``d:f16 | m:f16 | qs[16]``."""
    d = fp16_field(blocks, 0)
    m = fp16_field(blocks, 2)
    q = _low_high_nibbles(blocks[:, 4:20])
    return d * q + m


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0: ``d * (q - 16)``; layout ``d:f16 | qh[4] | qs[16]``."""
    d = fp16_field(blocks, 0)
    high = fifth_bits(blocks[:, 2:6])
    low = _low_high_nibbles(blocks[:, 6:22])
    q = (low | (high << 4)).view(torch.int8) - 16
    return d * q


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1: ``d * q + m``; layout ``d:f16 | m:f16 | qh[4] | qs[16]``."""
    d = fp16_field(blocks, 0)
    m = fp16_field(blocks, 2)
    high = fifth_bits(blocks[:, 4:8])
    low = _low_high_nibbles(blocks[:, 8:24])
    return d * (low | (high << 4)) + m


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: ``q * d``; layout ``d:f16 | qs:int8[32]``."""
    d = fp16_field(blocks, 0)
    return int8_field(blocks, 2, 34) * d
