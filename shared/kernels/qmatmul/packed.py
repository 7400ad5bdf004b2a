"""Load-time repacking of GGUF blocks into the layout the fast quantized matmuls read.

GGUF interleaves each block's scales with its quants and aligns blocks to 2 bytes, so a kernel
reading it in place issues byte loads. Repacking splits every weight into plane tensors that are
16-byte aligned and loaded as int32 words, with the quants of one "chunk" transposed so that
nibble (or byte) ``j`` of word ``i`` belongs to sub-block ``j``::

    Q4_K  q   int32 [N, K/8]    chunk = super-block of 256: nibble j of word i = element 32j + i
          sc  uint8 [N, K/32]   6-bit scale per sub-block (unpacked from the 12 packed bytes)
          mn  uint8 [N, K/32]   6-bit min per sub-block
          d, dmin  fp16 [N, K/256]
    Q6_K  q   int32 [N, K/8]    chunk = 128 elements: nibble j of word i = low bits of element
                                16j + i
          hi  int16 [N, K/8]    bits 2j..2j+1 of half-word i = high bits of element 16j + i
          sc  int8  [N, K/16]   scale per 16 elements (so one per nibble position j)
          d   fp16  [N, K/256]
    Q8_0  q   int32 [N, K/4]    chunk = 128 elements: byte j of word i = element 32j + i
          d   fp16  [N, K/32]
    Q5_K  Q4_K's planes and
          hi  uint8 [N, K/8]    bit j of byte i = fifth bit of element 32j + i (GGUF's own qh)
    Q4_0 / Q4_1 / Q5_0 / Q5_1   q as Q4_K's (chunks of 256, eight 32-element blocks);
          d (and m: in ``mn``)  fp16 [N, K/32]; hi as Q5_K's for the 5-bit ones
    Q2_K  q   int32 [N, K/16]   chunk = 256: 2-bit field j of word i = element 16j + i
          sc  uint8 [N, K/16]   scale (low nibble) and min (high nibble) per 16 elements
          d, dmin  fp16 [N, K/256]
    Q3_K  q   as Q2_K's (the low two bits)
          hi  int16 [N, K/16]   bit j of half-word i = hmask bit of element 16j + i
          sc  int8  [N, K/16]   6-bit scale minus 32 per 16 elements
          d   fp16  [N, K/256]

A kernel then loads one word per lane and splits it into values of different sub-blocks (one
scale each) whose activations are contiguous runs ``x[W*j : W*j + W]`` (W = words per chunk);
no byte shuffles remain in the loop.
On CUDA the planes of the int8 types are then interleaved in tiles of 32 rows
(``packed_rows``: same entries, other addresses) for the batch-1 GEMV with a thread a row.
The dequantized values of a packed weight (``unpack``) are bit-identical to ``gguf.quants``:
the same float32 expressions in the same order as ``shared.quant``. The planes together are
0-4 % larger than the GGUF blocks (Q4_K: 148 bytes per 256 instead of 144; Q3_K 114 for 110).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from shared.kernels.qmatmul.layout import CHUNK, PACKED_TYPES, PackedWeight
from shared.kernels.qmatmul.layout import LEGACY as _LEGACY
from shared.kernels.qmatmul.layout import TWO_BIT as _TWO_BIT
from shared.kernels.qmatmul.packed_rows import deinterleave
from shared.quant import block_geometry
from shared.quant.blocks import as_blocks, fp16_field, int8_field, unpack_bits
from shared.quant.kquants import unpack_scale_min_k4, unpack_scales_q3_k
from shared.quant.legacy import LAYOUT, fifth_bits

__all__ = ["pack", "unpack"]

_T = GGMLQuantizationType


def _pack_fields(codes: torch.Tensor, n: int, words: int, per_word: int, bits: int) -> torch.Tensor:
    """codes uint8 (values < 2^bits, element order, N * K in all) -> [n, K / per_word] integers
    of per_word * bits bits (int32, int16 or uint8): field j (bits ``bits*j`` up) of word i is
    element ``words * j + i`` of its chunk of ``words * per_word`` elements."""
    fields = codes.reshape(n, -1, per_word, words).transpose(2, 3)  # [n, chunks, i, j]
    per_byte = 8 // bits
    fields = fields.reshape(n, -1, words, per_word // per_byte, per_byte)
    byte = fields[..., 0]
    for t in range(1, per_byte):
        byte = byte | (fields[..., t] << (bits * t))
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[per_word * bits // 8]
    return byte.contiguous().view(dtype).reshape(n, -1)


def pack(raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> PackedWeight:
    """raw: uint8 GGUF rows ``[N, row_bytes]`` (any device) -> the packed planes there."""
    qtype = _T(qtype)
    if qtype not in PACKED_TYPES:
        raise ValueError(f"pack: {qtype.name} has no packed layout")
    n, k = shape
    if k % CHUNK[qtype]:
        raise ValueError(f"pack: K={k} is not a multiple of {CHUNK[qtype]} for {qtype.name}")
    block, size = block_geometry(qtype)
    blocks = as_blocks(raw, size)
    if blocks.shape[0] != n * k // block:
        raise ValueError(f"pack: {blocks.shape[0]} blocks do not make a {n}x{k} {qtype.name}")
    if qtype == _T.Q8_0:
        qs = int8_field(blocks, 2, 34).reshape(n, k // 128, 4, 32).transpose(2, 3)
        q = qs.contiguous().view(torch.int32).reshape(n, k // 4)
        d = fp16_field(blocks, 0).half().reshape(n, k // 32)
        return PackedWeight(qtype, (n, k), q=q, d=d)
    chunks = k // 256
    if qtype in _LEGACY:
        m_at, qh_at, qs_at, _ = LAYOUT[qtype]
        codes = unpack_bits(blocks[:, qs_at : qs_at + 16], 4, 16)  # [blocks, 32] in order
        hi = None
        if qh_at >= 0:
            hi = _pack_fields(fifth_bits(blocks[:, qh_at : qh_at + 4]), n, 32, 8, 1)
        return PackedWeight(
            qtype,
            (n, k),
            q=_pack_fields(codes, n, 32, 8, 4),
            d=fp16_field(blocks, 0).half().reshape(n, k // 32),
            mn=fp16_field(blocks, m_at).half().reshape(n, k // 32) if m_at >= 0 else None,
            hi=hi,
        )
    if qtype == _T.Q2_K:
        return PackedWeight(
            qtype,
            (n, k),
            q=_pack_fields(unpack_bits(blocks[:, 16:80], 2, 32), n, 16, 16, 2),
            sc=blocks[:, :16].reshape(n, k // 16).contiguous(),
            d=fp16_field(blocks, 80).half().reshape(n, chunks),
            dmin=fp16_field(blocks, 82).half().reshape(n, chunks),
        )
    if qtype == _T.Q3_K:
        sc = unpack_scales_q3_k(blocks[:, 96:108]).view(torch.int8) - 32
        return PackedWeight(
            qtype,
            (n, k),
            q=_pack_fields(unpack_bits(blocks[:, 32:96], 2, 32), n, 16, 16, 2),
            hi=_pack_fields(unpack_bits(blocks[:, :32], 1, 32), n, 16, 16, 1),
            sc=sc.reshape(n, k // 16).contiguous(),
            d=fp16_field(blocks, 108).half().reshape(n, chunks),
        )
    if qtype in (_T.Q4_K, _T.Q5_K):
        sc, mn = unpack_scale_min_k4(blocks[:, 4:16])
        qs_at = 48 if qtype == _T.Q5_K else 16
        return PackedWeight(
            qtype,
            (n, k),
            q=_pack_fields(unpack_bits(blocks[:, qs_at : qs_at + 128], 4, 32), n, 32, 8, 4),
            d=fp16_field(blocks, 0).half().reshape(n, chunks),
            dmin=fp16_field(blocks, 2).half().reshape(n, chunks),
            sc=sc.reshape(n, k // 32).contiguous(),
            mn=mn.reshape(n, k // 32).contiguous(),
            # Q5_K's qh already has the layout: bit j of byte i = element 32j + i
            hi=blocks[:, 16:48].reshape(n, k // 8).contiguous() if qtype == _T.Q5_K else None,
        )
    return PackedWeight(  # Q6_K
        qtype,
        (n, k),
        q=_pack_fields(unpack_bits(blocks[:, :128], 4, 64), n, 16, 8, 4),
        hi=_pack_fields(unpack_bits(blocks[:, 128:192], 2, 32), n, 16, 8, 2),
        sc=int8_field(blocks, 192, 208).reshape(n, k // 16).contiguous(),
        d=fp16_field(blocks, 208).half().reshape(n, chunks),
    )


def _codes(words: torch.Tensor, bits: int, per_word: int, width: int = 32) -> torch.Tensor:
    """int32/int16 words [n, w] -> uint8 [n, w / width chunks, per_word (j), width (i)] fields."""
    n, w = words.shape
    wide = words.to(torch.int32).reshape(n, w // width, 1, width)
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32).reshape(1, 1, -1, 1)
    return ((wide >> (shifts * bits)) & ((1 << bits) - 1)).to(torch.uint8)


def unpack(pw: PackedWeight) -> torch.Tensor:
    """float32 ``[N, K]``: the packed weight dequantized, bit-identical to ``gguf.quants``."""
    if pw.rows32:  # row-interleaved planes: the plain ones first
        pw = deinterleave(pw)
    n, k = pw.shape
    if pw.qtype == _T.Q8_0:
        q = _codes(pw.q, 8, 4).view(torch.int8).reshape(n, k // 32, 32)
        return (q * pw.d.float().reshape(n, k // 32, 1)).reshape(n, k)
    supers = k // 256
    if pw.qtype in _TWO_BIT:  # the expressions of shared.quant.kquants
        low = _codes(pw.q, 2, 16, 16).reshape(n, k // 16, 16)  # element order
        d = pw.d.float().reshape(n, supers, 1)
        if pw.qtype == _T.Q2_K:
            dl = (d * (pw.sc & 0x0F).float().reshape(n, supers, 16)).reshape(n, k // 16, 1)
            ml = pw.dmin.float().reshape(n, supers, 1) * (pw.sc >> 4).float().reshape(n, supers, 16)
            return (dl * low - ml.reshape(n, k // 16, 1)).reshape(n, k)
        high = _codes(pw.hi, 1, 16, 16).reshape(n, k // 16, 16)
        q = low.view(torch.int8) - ((high ^ 1) << 2).view(torch.int8)
        dl = (d * pw.sc.float().reshape(n, supers, 16)).reshape(n, k // 16, 1)
        return (dl * q).reshape(n, k)
    if pw.qtype != _T.Q6_K:
        low = _codes(pw.q, 4, 8)  # [n, supers, 8, 32]: element order within the chunk
        if pw.hi is not None:
            low = low | (_codes(pw.hi, 1, 8) << 4)
        if pw.qtype in _LEGACY:  # the expressions of shared.quant.legacy
            d = pw.d.float().reshape(n, supers, 8, 1)
            if pw.qtype in (_T.Q4_1, _T.Q5_1):
                return (d * low + pw.mn.float().reshape(n, supers, 8, 1)).reshape(n, k)
            bias = LAYOUT[pw.qtype][3]
            return (d * (low.view(torch.int8) - bias)).reshape(n, k)
        scale = pw.d.float().reshape(n, supers, 1) * pw.sc.float().reshape(n, supers, 8)
        offset = pw.dmin.float().reshape(n, supers, 1) * pw.mn.float().reshape(n, supers, 8)
        return (scale[..., None] * low - offset[..., None]).reshape(n, k)
    low = _codes(pw.q, 4, 8, 16)  # [n, chunks of 128, 8, 16]: one scale per 16 elements
    high = _codes(pw.hi, 2, 8, 16)
    q = (low | (high << 4)).view(torch.int8) - 32
    scale = pw.d.float().reshape(n, supers, 1) * pw.sc.float().reshape(n, supers, 16)
    return (scale.reshape(n, k // 16, 1) * q.reshape(n, k // 16, 16)).reshape(n, k)
