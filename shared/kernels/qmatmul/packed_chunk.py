"""Dequantizing packed weight rows in registers, one sub-block at a time: the shared inner step of
the packed GEMV and GEMM kernels (layout in ``shared.kernels.qmatmul.packed``).

A chunk is loaded as ``[BLOCK_N, W]`` int32 words (W = 32, or 16 for Q6_K); field ``j`` of every
word belongs to sub-block ``j`` (one scale), whose activations are the contiguous run
``x[W*j : W*j + W]`` of the chunk. ``group`` turns field j of the words into float32 weights of
the same ``[BLOCK_N, W]`` shape and layout, so nothing is reshaped or moved between threads.

Quants become floats without the slow integer-to-float conversion: a field masked in place (at
bit position p) is OR-ed into the mantissa of 2^23, and subtracting 2^23 leaves ``q * 2^p``
exactly. The scale is divided by the same power of two beforehand, so ``q * scale - offset`` is
one fused multiply-add on exact inputs: every value equals the reference dequantization
(``shared.quant``), whose products are exact in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q5_1 = tl.constexpr(7)
Q8_0 = tl.constexpr(8)
Q2_K = tl.constexpr(10)
Q3_K = tl.constexpr(11)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


@triton.jit
def _as_float(bits):
    """int32 holding a value v < 2^23 (anywhere in bits 0..22) -> float32 v, exactly."""
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def load_chunk(HI: tl.constexpr, q_ptr, hi_ptr, rows, nmask, c, stride_q, W: tl.constexpr):
    """Chunk c of the rows: (words, words >> 16, the high-bit plane's entries when HI, else w)."""
    i = tl.arange(0, W)
    offs = rows[:, None] * stride_q + c * W + i[None, :]
    w = tl.load(q_ptr + offs, mask=nmask[:, None], other=0)
    h = w
    if HI:
        h = tl.load(hi_ptr + offs, mask=nmask[:, None], other=0).to(tl.int32)
    return w, w >> 16, h


@triton.jit
def _two_bit(
    QTYPE: tl.constexpr,
    J: tl.constexpr,
    w,
    wh,
    h,
    sc_ptr,
    d_ptr,
    dmin_ptr,
    rows,
    nmask,
    c,
    stride_s,
    stride_d,
):
    """Q2_K / Q3_K: 2-bit field J (8 in w, 8 in w >> 16), one scale per 16 elements."""
    P: tl.constexpr = 2 * (J % 8)
    src = w
    if J >= 8:
        src = wh
    d = tl.load(d_ptr + rows * stride_d + c, mask=nmask, other=0).to(tl.float32)
    s_off = rows * stride_s + c * 16 + J
    q = _as_float(src & (0x3 << P))  # q * 2^P
    if QTYPE == Q2_K:  # (d * (sc & 15)) * q - dmin * (sc >> 4)
        dmin = tl.load(dmin_ptr + rows * stride_d + c, mask=nmask, other=0).to(tl.float32)
        sc = tl.load(sc_ptr + s_off, mask=nmask, other=0).to(tl.int32)
        scale = d * (sc & 0xF).to(tl.float32)
        val = q * (scale * (1.0 / (1 << P)))[:, None] - (dmin * (sc >> 4).to(tl.float32))[:, None]
    else:  # Q3_K: (d * (sc - 32)) * (q + 4 * hbit - 4), every partial result exact
        scale = d * tl.load(sc_ptr + s_off, mask=nmask, other=0).to(tl.float32)
        hb = _as_float(h & (1 << J))  # hmask bit * 2^J
        val = q * (scale * (1.0 / (1 << P)))[:, None] + (
            hb * (scale * (4.0 / (1 << J)))[:, None] - (4.0 * scale)[:, None]
        )
    return val


@triton.jit
def group(
    QTYPE: tl.constexpr,
    HI: tl.constexpr,  # the type has a high-bit plane (Q5_0, Q5_1, Q5_K, Q6_K)
    J: tl.constexpr,  # sub-block (field) index within the chunk
    w, wh, h,  # from load_chunk
    sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    rows, nmask, c,
    stride_s,  # entries per row of sc / mn (the legacy types' d and m: one per 32 elements)
    stride_d,  # entries per row of d / dmin (K-quants: one per 256 elements)
):  # fmt: skip
    """Field J of the chunk's words -> float32 weights [BLOCK_N, W]."""
    if QTYPE == Q8_0:
        # byte J: bits 8 * (J % 2) of w (J < 2) or of w >> 16
        P: tl.constexpr = 8 * (J % 2)
        src = w
        if J >= 2:
            src = wh
        d = tl.load(d_ptr + rows * stride_s + c * 4 + J, mask=nmask, other=0).to(tl.float32)
        u = _as_float((src & (0xFF << P)) ^ (0x80 << P))  # (q + 128) * 2^P
        val = u * (d * (1.0 / (1 << P)))[:, None] - (128.0 * d)[:, None]
    elif QTYPE == Q2_K:  # noqa: SIM114 - Triton's constexpr `if` takes no `or` chains
        val = _two_bit(
            QTYPE, J, w, wh, h, sc_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
        )
    elif QTYPE == Q3_K:
        val = _two_bit(
            QTYPE, J, w, wh, h, sc_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
        )
    elif QTYPE == Q6_K:  # (lo + 16 * hi - 32) * d * sc, lo a nibble of w, hi a bit pair of h
        P: tl.constexpr = 4 * (J % 4)
        src = w
        if J >= 4:
            src = wh
        d = tl.load(d_ptr + rows * stride_d + c // 2, mask=nmask, other=0).to(tl.float32)
        sc = tl.load(sc_ptr + rows * stride_s + c * 8 + J, mask=nmask, other=0).to(tl.float32)
        scale = d * sc  # exact
        lo = _as_float(src & (0xF << P))  # lo * 2^P
        hi = _as_float(h & (0x3 << (2 * J)))  # hi * 4^J
        s_lo = scale * (1.0 / (1 << P))
        s_hi = scale * (16.0 / (1 << (2 * J)))
        # every partial result is exact, so the value is the reference's
        val = lo * s_lo[:, None] + (hi * s_hi[:, None] - (32.0 * scale)[:, None])
    else:  # a low nibble of w, a fifth bit in h (Q5_*), then a scale and a min or offset
        P: tl.constexpr = 4 * (J % 4)
        src = w
        if J >= 4:
            src = wh
        g_off = rows * stride_s + c * 8 + J  # this sub-block's entry in the per-32 planes
        if QTYPE >= Q4_K:  # Q4_K, Q5_K: (d * sc) * q - dmin * mn
            d_off = rows * stride_d + c
            d = tl.load(d_ptr + d_off, mask=nmask, other=0).to(tl.float32)
            dmin = tl.load(dmin_ptr + d_off, mask=nmask, other=0).to(tl.float32)
            sc = tl.load(sc_ptr + g_off, mask=nmask, other=0).to(tl.float32)
            mn = tl.load(mn_ptr + g_off, mask=nmask, other=0).to(tl.float32)
            scale = d * sc  # exact
            shift = dmin * mn  # exact
        else:  # Q4_0, Q5_0: d * (q - bias); Q4_1, Q5_1: d * q + m
            scale = tl.load(d_ptr + g_off, mask=nmask, other=0).to(tl.float32)
            if QTYPE % 2 == 1:
                shift = -tl.load(mn_ptr + g_off, mask=nmask, other=0).to(tl.float32)
            elif QTYPE == Q4_0:
                shift = 8.0 * scale
            else:
                shift = 16.0 * scale
        q = _as_float(src & (0xF << P))  # q * 2^P
        s_lo = scale * (1.0 / (1 << P))
        if HI:
            hi = _as_float(h & (1 << J))  # fifth bit * 2^J
            # scale * q exactly (both products are exact), then the one rounding of the reference
            t = q * s_lo[:, None] + hi * (scale * (16.0 / (1 << J)))[:, None]
            val = t - shift[:, None]
        else:
            val = q * s_lo[:, None] - shift[:, None]
    return val
