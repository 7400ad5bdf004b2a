"""The weight side of the int8 GEMV over row-interleaved planes (``packed_int8_rows``): a
tile's quant words, high entries and scale words for the chunks in flight, loaded with the
config's cache hints, and a sub-block's scale pair taken out of the scale words.

Shapes put the rows first: Triton orders a load's dimensions by contiguity and then by index,
so the 32 lanes of a warp go to the rows (axis 0), the warps to the chunks in flight (axis 1)
and a chunk's groups stay in each thread's registers (axis 2): every tensor of the loop then
has one layout and nothing moves between threads before the final sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.qmatmul.layout import ROWS as _ROWS
from shared.kernels.qmatmul.packed_chunk import Q4_K, Q6_K, Q8_0, _byte, _half, _signed

__all__ = ["fetch", "scale_pair"]

ROWS = tl.constexpr(_ROWS)


@triton.jit
def _unit_words(ptr, tile, stride, c, r, U: tl.constexpr, EP: tl.constexpr = ""):
    """The unit of chunk c ([1, KW]) of rows r ([32, 1]) in an interleaved plane of U 64-bit
    words a unit: (word 0, word 1) as int64 ([32, KW] each; word 1 = word 0 when U is 1)."""
    base = ptr.to(tl.pointer_type(tl.int64)) + tile * ROWS * stride
    at = (c * ROWS + r) * U
    w0 = tl.load(base + at, eviction_policy=EP)
    w1 = w0
    if U == 2:
        w1 = tl.load(base + at + 1, eviction_policy=EP)
    return w0, w1


@triton.jit
def _per_row(ptr, tile, stride, e, r, EP: tl.constexpr = ""):
    """One fp16 entry a row: entry e ([1, KW]) of an interleaved unit-1 plane -> float32."""
    return tl.load(ptr + tile * ROWS * stride + e * ROWS + r, eviction_policy=EP).to(tl.float32)


@triton.jit
def _scales(QTYPE: tl.constexpr, HI: tl.constexpr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, c, r,
            stride_s, stride_d, EP: tl.constexpr = ""):  # fmt: skip
    """Chunk c's scale words of the rows: (a0, a1, b0, b1, fa, fb) with weight
    ``fa * a_j * q - fb * b_j`` for sub-block j (a_j, b_j taken out of the words by ``_pair``);
    EP: their loads' eviction policy."""
    if QTYPE == Q8_0:  # four fp16 d: one 64-bit word
        a0, a1 = _unit_words(d_ptr, tile, stride_s // 4, c, r, 1, EP)
        fa = tl.full(a0.shape, 1.0, dtype=tl.float32)
        return a0, a1, a0, a1, fa, fa * 0.0
    if QTYPE == Q6_K:  # eight int8 scales, d per 256 (every other chunk)
        a0, a1 = _unit_words(sc_ptr, tile, stride_s // 8, c, r, 1, EP)
        d = _per_row(d_ptr, tile, stride_d, c // 2, r, EP)
        return a0, a1, a0, a1, d, 32.0 * d
    if QTYPE >= Q4_K:  # eight scale bytes and eight min bytes, d and dmin per chunk
        a0, a1 = _unit_words(sc_ptr, tile, stride_s // 8, c, r, 1, EP)
        b0, b1 = _unit_words(mn_ptr, tile, stride_s // 8, c, r, 1, EP)
        d = _per_row(d_ptr, tile, stride_d, c, r, EP)
        return a0, a1, b0, b1, d, _per_row(dmin_ptr, tile, stride_d, c, r, EP)
    # legacy: eight fp16 d (and m) a chunk of 256: two 64-bit words
    a0, a1 = _unit_words(d_ptr, tile, stride_s // 4, c, r, 2, EP)
    one = tl.full(a0.shape, 1.0, dtype=tl.float32)
    if QTYPE % 2 == 1:
        b0, b1 = _unit_words(mn_ptr, tile, stride_s // 4, c, r, 2, EP)
        return a0, a1, b0, b1, one, -one
    if HI:
        return a0, a1, a0, a1, one, one * 16.0
    return a0, a1, a0, a1, one, one * 8.0


@triton.jit
def scale_pair(QTYPE: tl.constexpr, J: tl.constexpr, a0, a1, b0, b1):
    """Sub-block J's (a_j, b_j) from _scales' words."""
    if QTYPE == Q8_0:
        a = _half(a0, a1, J)
        return a, a
    if QTYPE == Q6_K:
        a = _signed(_byte(a0, a0, J)).to(tl.float32)
        return a, a
    if QTYPE >= Q4_K:
        return _byte(a0, a0, J).to(tl.float32), _byte(b0, b0, J).to(tl.float32)
    return _half(a0, a1, J), _half(b0, b1, J)


@triton.jit
def fetch(QTYPE: tl.constexpr, HI: tl.constexpr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
          tile, cb, c1, stride_q, stride_s, stride_d, W: tl.constexpr, KW: tl.constexpr,
          CM: tl.constexpr = "", EP: tl.constexpr = "", SEP: tl.constexpr = ""):  # fmt: skip
    """Every load of the chunks cb .. cb + KW - 1 (those below c1): the words [32, KW, NG, 4]
    (row r's four words of group g of chunk cb + k), the high entries [32, KW, NG] and the
    scale words (``_scales``, [32, KW] each). CM, EP: the words' and high entries' cache
    modifier and eviction policy, SEP the scale words' eviction policy (``WEIGHT_HINTS``)."""
    NG: tl.constexpr = W // 4
    r3 = tl.arange(0, ROWS)[:, None, None]
    # chunks past c1 read chunk c1 - 1 (in bounds, unmasked: no registers to clear first);
    # their activation scales are loaded as zero (_x_scales), so they add nothing
    k3 = tl.minimum(cb + tl.arange(0, KW), c1 - 1)[None, :, None]
    unit = k3 * NG + tl.arange(0, NG)[None, None, :]  # [1, KW, NG]: the group's index
    at = (unit * ROWS + r3) * 4  # [32, KW, NG]
    words = tl.load(
        q_ptr + tile * ROWS * stride_q + at[:, :, :, None] + tl.arange(0, 4)[None, None, None, :],
        cache_modifier=CM,
        eviction_policy=EP,
    )
    # the high entries of the group: loaded with a last axis of their own, as the words (a
    # [32, KW, NG] load would be vectorized along the rows, another layout)
    hi = at  # (no high plane: never read)
    if QTYPE == Q6_K:  # four int16 entries: two words, as one int64
        base = hi_ptr.to(tl.pointer_type(tl.int32)) + tile * ROWS * (stride_q // 2)
        h2 = tl.load(
            base + (unit * ROWS + r3)[:, :, :, None] * 2 + tl.arange(0, 2)[None, None, None, :],
            cache_modifier=CM,
            eviction_policy=EP,
        )
        lo, up = tl.split(h2)
        hi = (lo.to(tl.int64) & 0xFFFFFFFF) | (up.to(tl.int64) << 32)
    elif HI:  # four uint8 entries, as one word
        base = hi_ptr.to(tl.pointer_type(tl.uint8)) + tile * ROWS * stride_q
        h4 = tl.load(
            base + (unit * ROWS + r3)[:, :, :, None] * 4 + tl.arange(0, 4)[None, None, None, :],
            cache_modifier=CM,
            eviction_policy=EP,
        ).to(tl.int32)
        e, o = tl.split(tl.reshape(h4, (ROWS, KW, NG, 2, 2)))
        b0, b2 = tl.split(e)
        b1, b3 = tl.split(o)
        hi = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    c = tl.minimum(cb + tl.arange(0, KW), c1 - 1)[None, :]
    r = tl.arange(0, ROWS)[:, None]
    meta = _scales(QTYPE, HI, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, c, r, stride_s, stride_d,
                   SEP)  # fmt: skip
    return words, hi, meta
