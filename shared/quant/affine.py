"""The types whose weights are ``scale * code + offset`` over groups of 32 elements, as codes
and per-group float32 scales and offsets: what the CPU's int4 GEMM (``shared.model.int4_linear``)
is built from.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (one group a block) and Q4_K, Q5_K (eight a super-block) have one
scale and one offset per 32 elements; the codes are unsigned (Q8_0's and the biased legacy
types' shifted up, the shift moved into the offset). ``scale * code + offset`` in float32 is
``gguf.quants``' value, bit for bit but for the sign of a zero and a NaN's payload: every
product is exact (an fp16 significand times a code of at most 8 bits, or K-quants' ``d * sc``
as they form it), the add is the rounding gguf does too, and a biased type's ``d * (q - bias)``
is exact either way (its ``d * q - bias * d`` gives +0.0 where gguf's gives -0.0).
Q2_K, Q3_K and Q6_K scale 16 elements at a time: not here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType as T

from .blocks import as_blocks, fp16_field, unpack_bits
from .dequant import block_geometry
from .kquants import unpack_scale_min_k4
from .legacy import LAYOUT, fifth_bits

__all__ = ["AFFINE_TYPES", "Affine", "affine"]

GROUP = 32
# the bits of each type's codes
AFFINE_TYPES: dict[T, int] = {
    T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5,
}  # fmt: skip


class Affine(NamedTuple):
    codes: torch.Tensor  # [N, K] uint8, below 2 ** bits
    bits: int
    scale: torch.Tensor  # [N, K // 32] float32
    offset: torch.Tensor  # [N, K // 32] float32

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the weight (bit-identical to ``gguf.quants``)."""
        n, k = self.codes.shape
        codes = self.codes.reshape(n, k // GROUP, GROUP)
        w = self.scale[..., None] * codes + self.offset[..., None]
        return w.reshape(n, k)


def affine(raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> Affine:
    """The affine form of a weight's raw GGUF bytes ([N, row_bytes] or flat uint8)."""
    qtype = T(qtype)
    if qtype not in AFFINE_TYPES:
        raise ValueError(f"affine: {qtype.name} is not a type of 32-element affine groups")
    n, k = shape
    block, size = block_geometry(qtype)
    if k % block:
        raise ValueError(f"affine: K={k} is not a multiple of {qtype.name}'s block of {block}")
    blocks = as_blocks(raw, size)
    if qtype in LAYOUT:
        codes, scale, offset = _legacy(blocks, qtype)
    else:
        codes, scale, offset = _k4(blocks, qtype)
    groups = k // GROUP
    return Affine(
        codes.reshape(n, k).contiguous(),
        AFFINE_TYPES[qtype],
        scale.reshape(n, groups).contiguous(),
        offset.reshape(n, groups).contiguous(),
    )


def _legacy(blocks: torch.Tensor, qtype: T) -> tuple[torch.Tensor, ...]:
    """(codes [n, 32], scale [n], offset [n]) of 32-element blocks."""
    m_at, qh_at, qs_at, bias = LAYOUT[qtype]
    d = fp16_field(blocks, 0).reshape(-1)
    if qtype == T.Q8_0:  # signed bytes, shifted up by 128
        codes = (blocks[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return codes, d, d * -128.0
    codes = unpack_bits(blocks[:, qs_at : qs_at + 16], 4, 16)
    if qh_at >= 0:
        codes = codes | (fifth_bits(blocks[:, qh_at : qh_at + 4]) << 4)
    if m_at >= 0:  # d * q + m
        return codes, d, fp16_field(blocks, m_at).reshape(-1)
    return codes, d, d * float(-bias)  # d * (q - bias)


def _k4(blocks: torch.Tensor, qtype: T) -> tuple[torch.Tensor, ...]:
    """(codes [n, 256], scale [n, 8], offset [n, 8]) of Q4_K / Q5_K super-blocks."""
    d = fp16_field(blocks, 0)
    dmin = fp16_field(blocks, 2)
    sc, mn = unpack_scale_min_k4(blocks[:, 4:16])
    scale = d * sc.to(torch.float32)
    offset = -(dmin * mn.to(torch.float32))
    if qtype == T.Q4_K:
        codes = unpack_bits(blocks[:, 16:144], 4, 32)
    else:
        codes = unpack_bits(blocks[:, 48:176], 4, 32) | (unpack_bits(blocks[:, 16:48], 1, 32) << 4)
    return codes, scale, offset
