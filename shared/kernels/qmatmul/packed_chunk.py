"""Dequantizing one chunk of packed weight rows in registers: the shared inner step of the packed
GEMV and GEMM kernels (layout in ``shared.kernels.qmatmul.packed``).

A chunk (256 elements for Q4_K/Q6_K, 128 for Q8_0) comes back as two float32 halves
``[BLOCK_N, H]`` whose column ``t`` is element ``H * half + t`` of the chunk, so each half
multiplies a contiguous run of activations.

Quants become floats without the slow integer-to-float conversion: a field masked in place
(nibble ``j`` of a word keeps its position ``4j``) is OR-ed into the mantissa of 2^23, and
subtracting 2^23 leaves ``q * 16^j`` exactly. The scale is divided by the same power of two
beforehand, so ``q * scale - offset`` is one fused multiply-add on exact inputs: every value
equals the reference dequantization (``shared.quant``), whose products are exact in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

Q4_K: tl.constexpr = 12
Q6_K: tl.constexpr = 14
Q8_0: tl.constexpr = 8


@triton.jit
def _as_float(bits):
    """int32 holding a value v < 2^23 (anywhere in bits 0..22) -> float32 v, exactly."""
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _pow2(exponent):
    """float32 2**exponent for an int32 tensor of exponents in -126..127, exactly."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _q4_k_half(src, sc_ptrs, mn_ptrs, d, dmin, nmask, BLOCK_N: tl.constexpr):
    """src: [BLOCK_N, 32] words whose nibbles 0..3 are sub-blocks 4h..4h+3 of this half."""
    j = tl.arange(0, 4)
    sc = tl.load(sc_ptrs[:, None] + j[None, :], mask=nmask[:, None], other=0).to(tl.float32)
    mn = tl.load(mn_ptrs[:, None] + j[None, :], mask=nmask[:, None], other=0).to(tl.float32)
    scale = d[:, None] * sc * _pow2(-4 * j)[None, :]  # (d * sc) / 16^j, exact
    offset = dmin[:, None] * mn
    q = _as_float(src[:, None, :] & (0xF << (4 * j))[None, :, None])  # q * 16^j
    val = q * scale[:, :, None] - offset[:, :, None]
    return tl.reshape(val, (BLOCK_N, 128))


@triton.jit
def _q6_k_half(src, hsrc, sc_ptrs, d, nmask, BLOCK_N: tl.constexpr):
    """src: [BLOCK_N, 2, 16] low-nibble words (nibbles 0..3 = this half's j), hsrc: the matching
    high-bit half-words (bit pairs 0..3); scales are per 16 elements: index 2j + a."""
    j = tl.arange(0, 4)
    a = tl.arange(0, 2)
    sc_idx = 2 * j[:, None] + a[None, :]  # [4, 2]
    sc = tl.load(sc_ptrs[:, None, None] + sc_idx[None, :, :], mask=nmask[:, None, None], other=0)
    scale = d[:, None, None] * sc.to(tl.float32)  # [BLOCK_N, 4, 2], exact
    lo = _as_float(src[:, None, :, :] & (0xF << (4 * j))[None, :, None, None])  # lo * 16^j
    hi = _as_float(hsrc[:, None, :, :] & (0x3 << (2 * j))[None, :, None, None])  # hi * 4^j
    s_lo = (scale * _pow2(-4 * j)[None, :, None])[:, :, :, None]
    s_hi = (scale * _pow2(4 - 2 * j)[None, :, None])[:, :, :, None]
    # (lo + 16 * hi - 32) * scale, every partial result exact
    val = lo * s_lo + (hi * s_hi - 32.0 * scale[:, :, :, None])
    return tl.reshape(val, (BLOCK_N, 128))


@triton.jit
def _q8_0_half(src, d_ptrs, nmask, BLOCK_N: tl.constexpr):
    """src: [BLOCK_N, 32] words whose bytes 0, 1 are groups 2h, 2h + 1 of this half."""
    j = tl.arange(0, 2)
    d = tl.load(d_ptrs[:, None] + j[None, :], mask=nmask[:, None], other=0).to(tl.float32)
    field = src[:, None, :] & (0xFF << (8 * j))[None, :, None]
    u = _as_float(field ^ (0x80 << (8 * j))[None, :, None])  # (q + 128) * 256^j
    scale = d * _pow2(-8 * j)[None, :]
    val = u * scale[:, :, None] - (128.0 * d)[:, :, None]
    return tl.reshape(val, (BLOCK_N, 64))


@triton.jit
def dequant_chunk(
    QTYPE: tl.constexpr,
    q_ptr,
    hi_ptr,
    sc_ptr,
    mn_ptr,
    d_ptr,
    dmin_ptr,
    rows,  # [BLOCK_N] int64 row indices
    nmask,
    c,  # chunk index along K
    stride_q,  # words per row of q (and half-words per row of hi)
    stride_s,  # entries per row of sc / mn
    stride_d,  # entries per row of d / dmin
    BLOCK_N: tl.constexpr,
):
    """Chunk c of rows -> two float32 halves [BLOCK_N, H] (H = 128, or 64 for Q8_0)."""
    i = tl.arange(0, 32)
    w = tl.load(
        q_ptr + rows[:, None] * stride_q + c * 32 + i[None, :], mask=nmask[:, None], other=0
    )
    if QTYPE == Q8_0:
        d_ptrs = d_ptr + rows * stride_d + c * 4
        return _q8_0_half(w, d_ptrs, nmask, BLOCK_N), _q8_0_half(w >> 16, d_ptrs + 2, nmask, BLOCK_N)
    d = tl.load(d_ptr + rows * stride_d + c, mask=nmask, other=0).to(tl.float32)
    if QTYPE == Q4_K:
        dmin = tl.load(dmin_ptr + rows * stride_d + c, mask=nmask, other=0).to(tl.float32)
        sc_ptrs = sc_ptr + rows * stride_s + c * 8
        mn_ptrs = mn_ptr + rows * stride_s + c * 8
        v0 = _q4_k_half(w, sc_ptrs, mn_ptrs, d, dmin, nmask, BLOCK_N)
        v1 = _q4_k_half(w >> 16, sc_ptrs + 4, mn_ptrs + 4, d, dmin, nmask, BLOCK_N)
        return v0, v1
    # Q6_K: words as [BLOCK_N, 2, 16] so the per-16 scales broadcast over the last axis
    w = tl.reshape(w, (BLOCK_N, 2, 16))
    h = tl.load(
        hi_ptr + rows[:, None] * stride_q + c * 32 + i[None, :], mask=nmask[:, None], other=0
    ).to(tl.int32)
    h = tl.reshape(h, (BLOCK_N, 2, 16))
    sc_ptrs = sc_ptr + rows * stride_s + c * 16
    v0 = _q6_k_half(w, h, sc_ptrs, d, nmask, BLOCK_N)
    v1 = _q6_k_half(w >> 16, h >> 8, sc_ptrs + 8, d, nmask, BLOCK_N)
    return v0, v1
