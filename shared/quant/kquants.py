"""K-quant super-block formats (256 elements): Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.

Each function takes ``(n_blocks, type_size)`` uint8 blocks and returns
``(n_blocks, 256)`` float32, mirroring ``gguf.quants`` step by step: the per-sub-block
scale is formed first as a float32 product (``d * sc``, ``dmin * m``), then multiplied by
the quant, and any min is subtracted afterwards as its own operation.

Every product here is exact in float32 (an 11-bit fp16 significand times at most 13 bits
of integer scale and quant fits in 24 bits, Q6_K's ``2047 * 128 * 32`` included), so the
only rounding is the final subtraction of the min. The order is still gguf's, so that
signed zeros and the placement of inf/NaN (``inf * 0``) follow it too, and so the match
does not lean on that argument.

Integer quant tensors go into the multiply unconverted: torch promotes them to float32
exactly inside the kernel, saving a conversion pass over the full output size.
"""

from __future__ import annotations

import torch

from .blocks import fp16_field, int8_field, unpack_bits

__all__ = [
    "dequantize_q2_k",
    "dequantize_q3_k",
    "dequantize_q4_k",
    "dequantize_q5_k",
    "dequantize_q6_k",
    "unpack_scale_min_k4",
    "unpack_scales_q3_k",
]

QK_K = 256


def unpack_scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 bytes of 6-bit scales and mins into two ``(n, 8)`` uint8.

    Byte layout (upper-case: scales, lower-case: mins, one letter per sub-block)::

        0..3   EEAAAAAA FFBBBBBB GGCCCCCC HHDDDDDD
        4..7   eeaaaaaa ffbbbbbb ggcccccc hhdddddd
        8..11  eeeeEEEE ffffFFFF ggggGGGG hhhhHHHH
    """
    n_blocks = scales.shape[0]
    grid = scales.reshape(n_blocks, 3, 4)
    d, m, m_d = grid[:, 0], grid[:, 1], grid[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def unpack_scales_q3_k(scales: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes of 6-bit scales -> ``(n, 16)`` uint8 (still offset by 32).

    Low 4 bits: bytes 0..7, low nibbles for sub-blocks 0..7 and high nibbles for 8..15.
    High 2 bits: bytes 8..11, bit pair j of byte k belongs to sub-block 4 * j + k.
    """
    low = unpack_bits(scales[:, :8], 4, 8)
    high = unpack_bits(scales[:, 8:12], 2, 4)
    return (low & 0x0F) | ((high & 0x03) << 4)


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K: ``(d * sc) * q - dmin * m``; layout ``scales[16] | qs[64] | d | dmin``."""
    n_blocks = blocks.shape[0]
    scales = blocks[:, :16]
    d = fp16_field(blocks, 80)
    dmin = fp16_field(blocks, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n_blocks, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n_blocks, 16, 1)
    q = unpack_bits(blocks[:, 16:80], 2, 32).reshape(n_blocks, 16, 16)
    return (dl * q - ml).reshape(n_blocks, QK_K)


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K: ``(d * (sc - 32)) * q``; layout ``hmask[32] | qs[64] | scales[12] | d``.

    The quant is ``low2 - 4`` where the high-mask bit is *clear* (ggml subtracts 4 unless
    the bit is set), so q ranges over -4..3.
    """
    n_blocks = blocks.shape[0]
    d = fp16_field(blocks, 108)
    sc = (unpack_scales_q3_k(blocks[:, 96:108]).view(torch.int8) - 32).to(torch.float32)
    dl = (d * sc).reshape(n_blocks, 16, 1)
    low = unpack_bits(blocks[:, 32:96], 2, 32)
    high = unpack_bits(blocks[:, :32], 1, 32)
    q = low.view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)
    return (dl * q.reshape(n_blocks, 16, 16)).reshape(n_blocks, QK_K)


def _scaled_k4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Shared Q4_K/Q5_K header: d, dmin, then 12 bytes of packed scales/mins.
    n_blocks = blocks.shape[0]
    d = fp16_field(blocks, 0)
    dmin = fp16_field(blocks, 2)
    sc, mn = unpack_scale_min_k4(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).reshape(n_blocks, 8, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n_blocks, 8, 1)
    return scale, offset


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K: ``(d * sc) * q - dmin * m``; layout ``d | dmin | scales[12] | qs[128]``."""
    n_blocks = blocks.shape[0]
    scale, offset = _scaled_k4(blocks)
    q = unpack_bits(blocks[:, 16:144], 4, 32).reshape(n_blocks, 8, 32)
    return (scale * q - offset).reshape(n_blocks, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K: like Q4_K plus a fifth bit; layout ``d | dmin | scales[12] | qh[32] | qs[128]``.

    Bit j of ``qh[i]`` is the fifth bit of element ``32 * j + i``.
    """
    n_blocks = blocks.shape[0]
    scale, offset = _scaled_k4(blocks)
    low = unpack_bits(blocks[:, 48:176], 4, 32)
    high = unpack_bits(blocks[:, 16:48], 1, 32)
    q = (low | (high << 4)).reshape(n_blocks, 8, 32)
    return (scale * q - offset).reshape(n_blocks, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: ``(d * sc) * (q - 32)``; layout ``ql[128] | qh[64] | scales:int8[16] | d``.

    Low nibbles come in two 64-byte chunks (each giving 128 elements), high bit pairs in
    two 32-byte chunks (each giving 128 elements), so both unpack to the same order.
    """
    n_blocks = blocks.shape[0]
    d = fp16_field(blocks, 208)
    scale = (d * int8_field(blocks, 192, 208).to(torch.float32)).reshape(n_blocks, 16, 1)
    low = unpack_bits(blocks[:, :128], 4, 64)
    high = unpack_bits(blocks[:, 128:192], 2, 32)
    q = (low | (high << 4)).view(torch.int8) - 32
    return (scale * q.reshape(n_blocks, 16, 16)).reshape(n_blocks, QK_K)
