"""Dequantizing packed weight rows in registers, one sub-block at a time: the shared inner step of
the packed GEMV and GEMM kernels (layout in ``shared.kernels.qmatmul.packed``).

A chunk is loaded as ``[BLOCK_N, W]`` int32 words (W = 32, or 16 for Q6_K); field ``j`` of every
word belongs to sub-block ``j`` (one scale), whose activations are the contiguous run
``x[W*j : W*j + W]`` of the chunk. ``group`` turns field j of the words into float32 weights of
the same ``[BLOCK_N, W]`` shape and layout, so nothing is reshaped or moved between threads.

A chunk's scales are loaded once per row (``load_meta``), not once per sub-block: the per-chunk
run of 8 or 16 one-byte scales (or 4 or 8 fp16 ones) is read as one or two 64-bit words, and
``group`` takes its field out with a shift. So a kernel issues a handful of loads per chunk and
can request chunk c + 1's scales together with its quants, before chunk c is multiplied.

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
def _as_float(bits, mg):
    """int32 holding a value v < 2^23 (anywhere in bits 0..22) -> float32 v, exactly. mg is
    MAGIC (0x4B000000, the bits of 2^23) passed in as a kernel argument: in a register, the mask
    and the OR become one LOP3 (two immediates would take two)."""
    return (bits | mg).to(tl.float32, bitcast=True) - 8388608.0


MAGIC = 0x4B000000  # the bits of 2^23: launchers pass it to the kernels (see _as_float)


@triton.jit
def entry(R32: tl.constexpr, rows, e, stride, U: tl.constexpr):
    """Offset of entry e of the rows in a plane of `stride` entries a row: ``rows * stride +
    e``, or with R32 in the row-interleaved layout (``packed_rows``) whose units hold U
    entries."""
    if R32:
        return (rows // 32) * (32 * stride) + ((e // U) * 32 + rows % 32) * U + e % U
    return rows * stride + e


@triton.jit
def load_words(HI: tl.constexpr, q_ptr, hi_ptr, offs, mask):
    """Words at offs: (words, words >> 16, the high-bit plane's entries when HI, else w)."""
    w = tl.load(q_ptr + offs, mask=mask, other=0)
    h = w
    if HI:
        h = tl.load(hi_ptr + offs, mask=mask, other=0).to(tl.int32)
    return w, w >> 16, h


@triton.jit
def load_chunk(
    R32: tl.constexpr, HI: tl.constexpr, q_ptr, hi_ptr, rows, nmask, c, stride_q, W: tl.constexpr
):
    """Chunk c of the rows as [BLOCK_N, W] words (load_words); R32: row-interleaved planes."""
    i = tl.arange(0, W)
    offs = entry(R32, rows[:, None], c * W + i[None, :], stride_q, 4)
    return load_words(HI, q_ptr, hi_ptr, offs, nmask[:, None])


@triton.jit
def _half(s0, s1, J: tl.constexpr):
    """fp16 number J (0..7) of the pair of int64 words (s0: numbers 0..3) -> float32."""
    src = s0
    if J >= 4:
        src = s1
    bits = ((src >> (16 * (J % 4))) & 0xFFFF).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(s0, s1, J: tl.constexpr):
    """Byte J (0..15) of the pair of int64 words (s0: bytes 0..7) -> int32 0..255."""
    src = s0
    if J >= 8:
        src = s1
    return ((src >> (8 * (J % 8))) & 0xFF).to(tl.int32)


@triton.jit
def _signed(b):
    return (b ^ 0x80) - 0x80


@triton.jit
def _words(R32: tl.constexpr, ptr, rows, nmask, stride, c, PER: tl.constexpr, BYTES: tl.constexpr):
    """The PER 64-bit words of chunk c in a plane of BYTES-byte entries with `stride` entries a
    row (the chunk's entries are contiguous and 8-byte aligned: K is a multiple of the chunk;
    interleaved, they are the plane's unit)."""
    words = ptr.to(tl.pointer_type(tl.int64))
    per_row = stride // (8 // BYTES)
    w0 = tl.load(words + entry(R32, rows, c * PER, per_row, PER), mask=nmask, other=0)
    w1 = w0
    if PER == 2:
        w1 = tl.load(words + entry(R32, rows, c * PER + 1, per_row, PER), mask=nmask, other=0)
    return w0, w1


@triton.jit
def load_meta(
    R32: tl.constexpr, QTYPE: tl.constexpr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask, c,
    stride_s, stride_d,
):  # fmt: skip
    """Chunk c's scales of the rows: (s0, s1, m0, m1, d, dmin), [BLOCK_N] each. s0/s1 hold the
    per-sub-block scales (bytes, or fp16 for the legacy types and Q8_0), m0/m1 the mins, d/dmin
    the per-256 fp16 factors as float32; entries a type lacks repeat another (never read)."""
    if QTYPE == Q8_0:  # 4 fp16 d a chunk of 128
        s0, s1 = _words(R32, d_ptr, rows, nmask, stride_s, c, 1, 2)
        m0, m1 = s0, s1
        d = s0.to(tl.float32)
        dmin = d
    elif QTYPE == Q6_K:  # 8 int8 scales a chunk of 128, d per 256
        s0, s1 = _words(R32, sc_ptr, rows, nmask, stride_s, c, 1, 1)
        m0, m1 = s0, s1
        d = tl.load(d_ptr + entry(R32, rows, c // 2, stride_d, 1), mask=nmask, other=0)
        d = d.to(tl.float32)
        dmin = d
    elif QTYPE < Q2_K:  # legacy: 8 fp16 d (and m) a chunk of 256
        s0, s1 = _words(R32, d_ptr, rows, nmask, stride_s, c, 2, 2)
        m0, m1 = s0, s1
        if QTYPE % 2 == 1:
            m0, m1 = _words(R32, mn_ptr, rows, nmask, stride_s, c, 2, 2)
        d = s0.to(tl.float32)
        dmin = d
    else:  # K-quants with chunks of 256: 16 (Q2_K, Q3_K) or 8 (+ 8 mins) scale bytes
        if QTYPE >= Q4_K:
            s0, s1 = _words(R32, sc_ptr, rows, nmask, stride_s, c, 1, 1)
            m0, m1 = _words(R32, mn_ptr, rows, nmask, stride_s, c, 1, 1)
        else:
            s0, s1 = _words(R32, sc_ptr, rows, nmask, stride_s, c, 2, 1)
            m0, m1 = s0, s1
        d = tl.load(d_ptr + entry(R32, rows, c, stride_d, 1), mask=nmask, other=0)
        d = d.to(tl.float32)
        dmin = d
        if QTYPE != Q3_K:
            dmin = tl.load(dmin_ptr + entry(R32, rows, c, stride_d, 1), mask=nmask, other=0)
            dmin = dmin.to(tl.float32)
    return s0, s1, m0, m1, d, dmin


@triton.jit
def _two_bit(QTYPE: tl.constexpr, J: tl.constexpr, w, wh, h, s0, s1, d, dmin, mg):
    """Q2_K / Q3_K: 2-bit field J (8 in w, 8 in w >> 16), one scale per 16 elements."""
    P: tl.constexpr = 2 * (J % 8)
    src = w
    if J >= 8:
        src = wh
    q = _as_float(src & (0x3 << P), mg)  # q * 2^P
    sc = _byte(s0, s1, J)
    if QTYPE == Q2_K:  # (d * (sc & 15)) * q - dmin * (sc >> 4)
        scale = d * (sc & 0xF).to(tl.float32)
        val = q * (scale * (1.0 / (1 << P)))[:, None] - (dmin * (sc >> 4).to(tl.float32))[:, None]
    else:  # Q3_K: (d * (sc - 32)) * (q + 4 * hbit - 4), every partial result exact
        scale = d * _signed(sc).to(tl.float32)
        hb = _as_float(h & (1 << J), mg)  # hmask bit * 2^J
        val = q * (scale * (1.0 / (1 << P)))[:, None] + (
            hb * (scale * (4.0 / (1 << J)))[:, None] - (4.0 * scale)[:, None]
        )
    return val


@triton.jit
def _nibble_scale(QTYPE: tl.constexpr, J: tl.constexpr, s0, s1, m0, m1, d, dmin):
    """Sub-block J of a 4- or 5-bit type: (scale, shift), weight = code * scale - shift, both
    exact in float32."""
    if QTYPE >= Q4_K:  # Q4_K, Q5_K: (d * sc) * q - dmin * mn
        scale = d * _byte(s0, s0, J).to(tl.float32)
        shift = dmin * _byte(m0, m0, J).to(tl.float32)
    else:  # Q4_0, Q5_0: d * (q - bias); Q4_1, Q5_1: d * q + m
        scale = _half(s0, s1, J)
        if QTYPE % 2 == 1:
            shift = -_half(m0, m1, J)
        elif QTYPE == Q4_0:
            shift = 8.0 * scale
        else:
            shift = 16.0 * scale
    return scale, shift


@triton.jit
def group(
    QTYPE: tl.constexpr,
    HI: tl.constexpr,  # the type has a high-bit plane (Q5_0, Q5_1, Q5_K, Q6_K)
    J: tl.constexpr,  # sub-block (field) index within the chunk
    w, wh, h,  # from load_chunk
    s0, s1, m0, m1, d, dmin,  # from load_meta
    mg,  # MAGIC, a kernel argument (see _as_float)
):  # fmt: skip
    """Field J of the chunk's words -> float32 weights [BLOCK_N, W]."""
    if QTYPE == Q8_0:
        # byte J: bits 8 * (J % 2) of w (J < 2) or of w >> 16
        P: tl.constexpr = 8 * (J % 2)
        src = w
        if J >= 2:
            src = wh
        dj = _half(s0, s0, J)
        u = _as_float((src & (0xFF << P)) ^ (0x80 << P), mg)  # (q + 128) * 2^P
        val = u * (dj * (1.0 / (1 << P)))[:, None] - (128.0 * dj)[:, None]
    elif QTYPE == Q2_K:  # noqa: SIM114 - Triton's constexpr `if` takes no `or` chains
        val = _two_bit(QTYPE, J, w, wh, h, s0, s1, d, dmin, mg)
    elif QTYPE == Q3_K:
        val = _two_bit(QTYPE, J, w, wh, h, s0, s1, d, dmin, mg)
    elif QTYPE == Q6_K:  # (lo + 16 * hi - 32) * d * sc, lo a nibble of w, hi a bit pair of h
        P: tl.constexpr = 4 * (J % 4)
        src = w
        if J >= 4:
            src = wh
        scale = d * _signed(_byte(s0, s0, J)).to(tl.float32)  # exact
        lo = _as_float(src & (0xF << P), mg)  # lo * 2^P
        hi = _as_float(h & (0x3 << (2 * J)), mg)  # hi * 4^J
        s_lo = scale * (1.0 / (1 << P))
        s_hi = scale * (16.0 / (1 << (2 * J)))
        # every partial result is exact, so the value is the reference's
        val = lo * s_lo[:, None] + (hi * s_hi[:, None] - (32.0 * scale)[:, None])
    else:  # a low nibble of w, a fifth bit in h (Q5_*), then a scale and a min or offset
        P: tl.constexpr = 4 * (J % 4)
        src = w
        if J >= 4:
            src = wh
        scale, shift = _nibble_scale(QTYPE, J, s0, s1, m0, m1, d, dmin)
        q = _as_float(src & (0xF << P), mg)  # q * 2^P
        s_lo = scale * (1.0 / (1 << P))
        if HI:
            hi = _as_float(h & (1 << J), mg)  # fifth bit * 2^J
            # scale * q exactly (both products are exact), then the one rounding of the reference
            t = q * s_lo[:, None] + hi * (scale * (16.0 / (1 << J)))[:, None]
            val = t - shift[:, None]
        else:
            val = q * s_lo[:, None] - shift[:, None]
    return val


@triton.jit
def _plus_high(q, h, BIT: tl.constexpr, TO: tl.constexpr, mg):
    """q + (h's bit(s) at BIT, as a value) * 2^TO / 2^BIT: the high part of a code, exact."""
    return q + _as_float(h & BIT, mg) * ((1 << TO) * (1.0 / BIT))


@triton.jit
def fields(
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    J: tl.constexpr,
    w, wh, h,  # from load_chunk (any shape with rows first)
    s0, s1, m0, m1, d, dmin,  # from load_meta
    mg,  # MAGIC, a kernel argument (see _as_float)
):  # fmt: skip
    """Field J factored for a dot product: (Q, A, B) with weight = Q * A - B, Q = code * 2^P
    exact (the unsigned code of the field, high bits included) and A, B one per row. A GEMV sums
    ``Q * x`` first and scales once per sub-block: ``A * sum(Q x) - B * sum(x)``, not the weight
    element by element (the sum of products is not the reference's elementwise rounding)."""
    if QTYPE == Q8_0:
        P: tl.constexpr = 8 * (J % 2)
        src = w
        if J >= 2:
            src = wh
        q = _as_float((src & (0xFF << P)) ^ (0x80 << P), mg)  # (q + 128) * 2^P
        dj = _half(s0, s0, J)
        a = dj * (1.0 / (1 << P))
        b = 128.0 * dj
    elif QTYPE == Q2_K:
        P: tl.constexpr = 2 * (J % 8)
        src = w
        if J >= 8:
            src = wh
        q = _as_float(src & (0x3 << P), mg)
        sc = _byte(s0, s1, J)
        a = (d * (1.0 / (1 << P))) * _as_float(sc & 0xF, mg)
        b = dmin * _as_float(sc >> 4, mg)
    elif QTYPE == Q3_K:  # code q + 4 * hbit, weight (code - 4) * scale
        P: tl.constexpr = 2 * (J % 8)
        src = w
        if J >= 8:
            src = wh
        q = _plus_high(_as_float(src & (0x3 << P), mg), h, 1 << J, P + 2, mg)
        scale = d * _signed(_byte(s0, s1, J)).to(tl.float32)
        a = scale * (1.0 / (1 << P))
        b = 4.0 * scale
    elif QTYPE == Q6_K:  # code lo + 16 * hi, weight (code - 32) * scale
        P: tl.constexpr = 4 * (J % 4)
        src = w
        if J >= 4:
            src = wh
        lo = _as_float(src & (0xF << P), mg)
        q = lo + _as_float(h & (0x3 << (2 * J)), mg) * ((1 << (P + 4)) * (1.0 / (1 << (2 * J))))
        scale = d * _signed(_byte(s0, s0, J)).to(tl.float32)
        a = scale * (1.0 / (1 << P))
        b = 32.0 * scale
    else:  # a nibble (and a fifth bit): Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K
        P: tl.constexpr = 4 * (J % 4)
        src = w
        if J >= 4:
            src = wh
        q = _as_float(src & (0xF << P), mg)
        if HI:
            q = _plus_high(q, h, 1 << J, P + 4, mg)
        scale, b = _nibble_scale(QTYPE, J, s0, s1, m0, m1, d, dmin)
        a = scale * (1.0 / (1 << P))
    return q, a, b
