"""A quantized weight kept 4-bit on the CPU, multiplied by torch's int4 GEMM.

torch's CPU kernel (``aten._weight_int4pack_mm_for_cpu``, AVX2/AVX-512 where the CPU has them)
multiplies bf16 activations by 4-bit codes ``q`` with a bf16 scale ``s`` and zero ``z`` per
group of 32 along K: ``w = (q - 8) * s + z``. A weight of the 32-element affine types
(``shared.quant.affine``: ``w = scale * code + offset``) becomes one such plane where its codes
have 4 bits, and two where they have 5 or 8: the centred code ``code - 2^(bits-1) = 16 * hi +
lo`` (``hi`` signed) gives a high plane of scale ``16 * scale`` and zero 0 and a low plane of
``scale`` and ``offset + (2^(bits-1) + 8) * scale``, and the two products are added. Centring
keeps each plane's terms as small as the weight (Q8_0's and Q5_0's low zero is exactly ``8 *
scale``): with the codes uncentred, terms of ``128 * scale`` cancel between the planes and
their bf16 scales' rounding does not (Gemma 3's top-1 agreement with llama.cpp fell to 0.83).
So Q4_0, Q4_1 and Q4_K read half a byte a weight and Q5_0, Q5_1, Q5_K and Q8_0 one byte,
against four for a float32 copy: decode on the CPU is memory-bound.

The scales and zeros are rounded to bf16 (a relative 2^-9), the activations too, and the
kernel returns bf16: the product is not the float32 reference's, but within the logit-fidelity
tests' bounds (tests/test_int4_linear.py, tests/test_logits.py).
"""

from __future__ import annotations

import torch

from shared.quant.affine import AFFINE_TYPES, GROUP, affine

__all__ = ["Int4Weight", "int4_supported"]

_N_MULTIPLE = 16  # the kernel's packing takes rows in sixteens
_CHUNK = 4096  # rows built at a time: whole blocks of the packing's 64 rows


def int4_supported(qtype: int, shape: tuple[int, int]) -> bool:
    """Whether a weight of this type and shape can be kept as int4 planes here."""
    n, k = shape
    return qtype in AFFINE_TYPES and n % _N_MULTIPLE == 0 and k % GROUP == 0 and _has_kernel()


def _has_kernel() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


def _planes(raw: torch.Tensor, qtype: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The planes of raw's rows: one for 4-bit codes, two for 5 or 8 bits (centred codes
    ``c = code - 2^(bits-1) = 16 * hi + lo``, hi signed, lo in 0..15)."""
    form = affine(raw, qtype, (raw.shape[0], k))
    if form.bits <= 4:
        return [_plane(form.codes, form.scale, form.offset + 8.0 * form.scale)]
    half = 1 << (form.bits - 1)
    c = form.codes.to(torch.int16) - half
    offset = form.offset + half * form.scale  # 0 for Q5_0 and Q8_0
    return [
        _plane((c >> 4) + 8, 16.0 * form.scale, torch.zeros_like(form.scale)),
        _plane(c & 15, form.scale, offset + 8.0 * form.scale),
    ]


def _plane(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, [G, N, 2] bf16 scales and zeros) of one plane: w = (q - 8) * s + z."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return packed, torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()


class Int4Weight:
    """One or two int4 planes of a [N, K] weight and their bf16 scales and zeros."""

    def __init__(self, raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> None:
        self.shape = shape
        n, k = shape
        rows = raw.reshape(n, -1)
        # built _CHUNK rows at a time: the int32 codes the packing takes are 8x the weight
        # (Gemma 3's 262,144-row embedding: 671 MB at once)
        parts = [_planes(rows[r : r + _CHUNK], qtype, k) for r in range(0, n, _CHUNK)]
        self.planes: list[tuple[torch.Tensor, torch.Tensor]] = [  # (packed codes, [G, N, 2])
            (torch.cat([p[i][0] for p in parts]), torch.cat([p[i][1] for p in parts], dim=1))
            for i in range(len(parts[0]))
        ]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) @ W.T: [M, N] in x's dtype."""
        xb = x.to(torch.bfloat16).contiguous()
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        y = None
        for packed, sz in self.planes:
            part = mm(xb, packed, GROUP, sz).to(x.dtype)
            y = part if y is None else y.add_(part)
        return y

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] as the kernel sees it: (q - 8) * s + z with the bf16 scales, summed
        over the planes (for tests; the exact weight is ``affine(...).dequantize()``)."""
        n, k = self.shape
        eye = torch.eye(k, dtype=torch.bfloat16)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return sum(mm(eye, p, GROUP, sz).float() for p, sz in self.planes).T.reshape(n, k)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() + sz.numel() * 2 for p, sz in self.planes)
