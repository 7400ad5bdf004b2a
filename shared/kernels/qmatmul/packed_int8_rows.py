"""The int8-activation GEMV over row-interleaved planes (``packed_rows``): a thread a row.

``packed_int8``'s threads each read whole chunks of one row, so a warp's 128-bit load touches
32 rows (one sector each, fetched again by the next load: ncu on the H200 counted 56 % excess
L2 sectors, BENCHMARKS.md 2026-11-30 (r)); its one-tile variant coalesces by spreading a row
over threads and becomes L1-bound reading every thread's own activations and scales. Here the
planes are interleaved in tiles of 32 rows, and a warp owns a tile:

- thread t of a warp is row t of the tile. One 128-bit load per thread reads four words of
  the row, and the warp's 32 loads are 512 contiguous bytes (the interleaved unit);
- the activations of those words are the same for every row: one broadcast load serves the
  warp (int8 codes from ``int8_activations``, as ``packed_int8`` rounds them);
- the warps of a program (``num_warps``) take successive chunks of the program's split, so a
  chunk's four-word groups stay in one thread: its int32 sums per sub-block need no shuffle,
  and the scales meet them once per chunk (``scale_j * dx_j * sum(q * xq) - shift_j * sum(x)``);
- split-K over a second grid axis, the last program of a tile adding the partials
  (``split_tickets``);
- on Hopper it is launched early (``gdc``): a program loads its first chunks' weights, then
  waits for the kernel that rounded the activations.

The result equals ``packed_int8``'s up to float32 summation order (the same rounded
activations, the same integer sums per sub-block): tests/test_kernel_packed_int8_rows.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.gdc import launch_kw, launch_next, pdl, wait_prev
from shared.kernels.qmatmul.int8_activations import int8_buffers, prepare_int8
from shared.kernels.qmatmul.int8_ops import dot4
from shared.kernels.qmatmul.packed_chunk import Q4_K, Q6_K, Q8_0, _byte, _half, _signed
from shared.kernels.qmatmul.packed_gemm import fields, planes, strides
from shared.kernels.qmatmul.packed_int8 import _codes, _round_split
from shared.kernels.qmatmul.packed_rows import ROWS as _ROWS
from shared.kernels.qmatmul.packed_rows import ROWS_TYPES
from shared.kernels.qmatmul.split_tickets import finish_rows, round_gated

__all__ = [
    "CACHE_HINTS",
    "DEFAULT_CACHE",
    "ROWS_TYPES",
    "gemv_int8_rows_kernel",
    "launch_int8_rows",
    "maxnreg",
]

ROWS = tl.constexpr(_ROWS)
# config key CACHE: how the weights are loaded, (the words' cache modifier, their eviction policy,
# the scale words' eviction policy). Each is read once: 1 marks the words first to leave L1 and
# L2, 3 the scales too, 2 keeps the words out of L1 (".cg"; ptxas refuses it with a policy), 0
# plain loads.
CACHE_HINTS = {
    0: ("", "", ""),
    1: ("", "evict_first", ""),
    2: (".cg", "", ""),
    3: ("", "evict_first", "evict_first"),
}
# a config without CACHE: evict-first. H200 (BENCHMARKS.md 2026-12-01 (z)): no shape of Q4_K_M
# lost with it beyond the noise (0.3 %) and ".cg" was never ahead (tools.tune_decode); W1 against
# plain loads +4.2 % Q4_K_M, +1.7 % Q6_K and Q8_0; the scales evict-first too (3) within noise.
DEFAULT_CACHE = 1


def maxnreg(qtype: int) -> int | None:
    """The register cap a thread (None: the compiler's choice). Left to itself the compiler gave
    Q4_K 82: five 4-warp programs an SM, so the 896 programs of a 28672-row or 4096x14336 GEMV
    ran in 1.4 waves. 72 fits seven (924 programs on 132 SMs: one wave) and spills less than
    64 (ncu: 43,008 local-memory spill requests in the Q4_K 28672x4096 GEMV at 64, BENCHMARKS.md
    2026-11-30 (w)). On the H200, W1 Q4_K_M: 383.7 tok/s uncapped, 397.5 at 64 ((v)); in one
    call of (w), 385.0 at 64 and 399.9 at 72. Q8_0 keeps the compiler's choice: its 61 registers
    fit eight programs already, and the cap at 64 cost it 1.3 % ((v))."""
    return None if qtype == int(Q8_0) else 72


# Shapes put the rows first: Triton orders a load's dimensions by contiguity and then by
# index, so the 32 lanes of a warp go to the rows (axis 0), the warps to the chunks in flight
# (axis 1) and a chunk's groups stay in each thread's registers (axis 2): every tensor of the
# loop then has one layout and nothing moves between threads before the final sum.


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
def _pair(QTYPE: tl.constexpr, J: tl.constexpr, a0, a1, b0, b1):
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
def _load(QTYPE: tl.constexpr, HI: tl.constexpr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
          tile, cb, c1, stride_q, stride_s, stride_d, W: tl.constexpr, KW: tl.constexpr,
          CM: tl.constexpr = "", EP: tl.constexpr = "", SEP: tl.constexpr = ""):  # fmt: skip
    """Every load of the chunks cb .. cb + KW - 1 (those below c1): the words [32, KW, NG, 4]
    (row r's four words of group g of chunk cb + k), the high entries [32, KW, NG] and the
    scale words (``_scales``, [32, KW] each). CM, EP: the words' and high entries' cache
    modifier and eviction policy, SEP the scale words' eviction policy (``CACHE_HINTS``)."""
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


@triton.jit
def _x_words(xq_ptr, cb, c1, NG: tl.constexpr, KW: tl.constexpr, G: tl.constexpr,
             J0: tl.constexpr):  # fmt: skip
    """The activation words of fields J0 .. J0 + 3 of every group, [32, KW, NG] each (the
    same address for the 32 rows: one broadcast load a warp)."""
    k = tl.minimum(cb + tl.arange(0, KW), c1 - 1)[None, :, None, None]  # as _load's
    g = tl.arange(0, NG)[None, None, :, None]
    at = (k * NG + g) * G + J0 + tl.arange(0, 4)[None, None, None, :]
    x = tl.load(xq_ptr + tl.broadcast_to(at, (ROWS, KW, NG, 4)))
    e, o = tl.split(tl.reshape(x, (ROWS, KW, NG, 2, 2)))
    x0, x2 = tl.split(e)
    x1, x3 = tl.split(o)
    return x0, x1, x2, x3


@triton.jit
def _x_scales(ptr, cb, c1, KW: tl.constexpr, G: tl.constexpr, J0: tl.constexpr,
              VEC: tl.constexpr):  # fmt: skip
    """Fields J0 .. J0 + 3's activation scales (or sums) of the chunks, [32, KW] each, zero
    for chunks at or past c1 (their words are chunk c1 - 1's again, _load's), so they add
    nothing. VEC: one broadcast 16-byte load a warp, else four scalar ones (H200 W1, (x): Q8_0
    351.4 tok/s with four against 347.7 with one; Q6_K 402.3 against 403.4, Q4_K_M 417.7
    against 419.3)."""
    k = (cb + tl.arange(0, KW))[None, :, None]
    if VEC:
        at = tl.broadcast_to(k * G + J0 + tl.arange(0, 4)[None, None, :], (ROWS, KW, 4))
        v = tl.load(ptr + at, mask=tl.broadcast_to(k < c1, (ROWS, KW, 4)), other=0.0)
        e, o = tl.split(tl.reshape(v, (ROWS, KW, 2, 2)))
        v0, v2 = tl.split(e)
        v1, v3 = tl.split(o)
        return v0, v1, v2, v3
    c = tl.broadcast_to((cb + tl.arange(0, KW))[None, :], (ROWS, KW))
    live = c < c1
    v0 = tl.load(ptr + c * G + J0, mask=live, other=0.0)
    v1 = tl.load(ptr + c * G + J0 + 1, mask=live, other=0.0)
    v2 = tl.load(ptr + c * G + J0 + 2, mask=live, other=0.0)
    v3 = tl.load(ptr + c * G + J0 + 3, mask=live, other=0.0)
    return v0, v1, v2, v3


@triton.jit
def _field(part, add, n, x, dx, sx, a, b, S: tl.constexpr, OFFSET: tl.constexpr,
           INTERPRETED: tl.constexpr):  # fmt: skip
    """One sub-block of the chunks: part += a * dx * sum over groups of dp4a(codes, x),
    add += b * sx (sx: the sum of its activations)."""
    isum = tl.sum(dot4(n, x, S, INTERPRETED), axis=2)  # [32, KW]
    part += a * (dx * isum.to(tl.float32))
    if OFFSET:
        add += b * sx
    return part, add


@triton.jit
def _four(part, add, n0, n1, n2, n3, x0, x1, x2, x3, xd_ptr, xs_ptr, a0, a1, b0, b1, cb, c1,
          QTYPE: tl.constexpr, J0: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
          KW: tl.constexpr, S: tl.constexpr, OFFSET: tl.constexpr,
          INTERPRETED: tl.constexpr):  # fmt: skip
    """Sub-blocks J0 .. J0 + 3: their codes n* ([32, KW * NG]) and activation words x*."""
    shape: tl.constexpr = (ROWS, KW, NG)
    VEC: tl.constexpr = QTYPE != Q8_0
    d0, d1, d2, d3 = _x_scales(xd_ptr, cb, c1, KW, G, J0, VEC)
    s0, s1, s2, s3 = d0, d1, d2, d3  # (never read without OFFSET)
    if OFFSET:
        s0, s1, s2, s3 = _x_scales(xs_ptr, cb, c1, KW, G, J0, VEC)
    a, b = _pair(QTYPE, J0, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n0, shape), x0, d0, s0, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    a, b = _pair(QTYPE, J0 + 1, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n1, shape), x1, d1, s1, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    a, b = _pair(QTYPE, J0 + 2, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n2, shape), x2, d2, s2, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    a, b = _pair(QTYPE, J0 + 3, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n3, shape), x3, d3, s3, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    return part, add


@triton.jit
def _compute(acc, cb, c1, loaded, xq_ptr, xd_ptr, xs_ptr, QTYPE: tl.constexpr, HI: tl.constexpr,
             W: tl.constexpr, G: tl.constexpr, KW: tl.constexpr,
             INTERPRETED: tl.constexpr):  # fmt: skip
    """acc [32, KW] += the chunks' parts of the rows' dot products."""
    NG: tl.constexpr = W // 4
    S: tl.constexpr = QTYPE == Q8_0  # signed codes
    OFFSET: tl.constexpr = QTYPE != Q8_0
    words, hi, meta = loaded
    a0, a1, b0, b1, fa, fb = meta
    w4 = tl.reshape(words, (ROWS, KW * NG, 4))
    n0, n1, n2, n3, n4, n5, n6, n7 = _codes(
        QTYPE, HI, w4, tl.reshape(hi, (ROWS, KW * NG)), ROWS, KW * NG, INTERPRETED
    )
    part = tl.zeros((ROWS, KW), dtype=tl.float32)
    add = tl.zeros((ROWS, KW), dtype=tl.float32)
    x0, x1, x2, x3 = _x_words(xq_ptr, cb, c1, NG, KW, G, 0)
    part, add = _four(part, add, n0, n1, n2, n3, x0, x1, x2, x3, xd_ptr, xs_ptr, a0, a1, b0, b1,
                      cb, c1, QTYPE, 0, G, NG, KW, S, OFFSET, INTERPRETED)  # fmt: skip
    if G == 8:
        x4, x5, x6, x7 = _x_words(xq_ptr, cb, c1, NG, KW, G, 4)
        part, add = _four(part, add, n4, n5, n6, n7, x4, x5, x6, x7, xd_ptr, xs_ptr, a0, a1, b0,
                          b1, cb, c1, QTYPE, 4, G, NG, KW, S, OFFSET, INTERPRETED)  # fmt: skip
    return acc + fa * part - fb * add


@triton.jit
def row_sums(x_ptr, xq_ptr, xd_ptr, xs_ptr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile,
             c0, c1, stride_q, stride_s, stride_d, QTYPE: tl.constexpr, HI: tl.constexpr,
             W: tl.constexpr, G: tl.constexpr, KW: tl.constexpr, PREFETCH: tl.constexpr,
             QX: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr, CM: tl.constexpr,
             EP: tl.constexpr, SEP: tl.constexpr):  # fmt: skip
    """The 32 rows' dot products over chunks c0 .. c1 - 1 of row tile `tile` ([32] float32):
    the first chunks' weights requested before ``wait_prev`` (PDL), the activations after it
    (rounded here first with QX). Arguments as gemv_int8_rows_kernel's."""
    acc = tl.zeros((ROWS, KW), dtype=tl.float32)
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)
        cb = c0
        while cb < c1:
            cur = _load(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb, c1,
                        stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            acc = _compute(acc, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, True)
            cb += KW
    elif not PREFETCH:
        # the first chunks' weights load while the previous kernel ends (PDL); the rest as a loop
        cur = _load(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, c0, c1,
                    stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
        wait_prev(PDL)
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)
        acc = _compute(acc, c0, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, False)
        for cb in range(c0 + KW, c1, KW):
            cur = _load(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb, c1,
                        stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            acc = _compute(acc, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, False)
    else:
        cur = _load(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, c0, c1,
                    stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
        wait_prev(PDL)
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)  # the first loads in flight
        for cb in range(c0, c1, KW):
            nxt = _load(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb + KW,
                        c1, stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            acc = _compute(acc, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, False)
            cur = nxt
    return tl.sum(acc, axis=1)


@triton.jit
def gemv_int8_rows_kernel(
    x_ptr,  # [K] activations (read only with QX)
    xq_ptr, xd_ptr, xs_ptr,  # the rounded activations (int8_activations) for the weight's (W, G)
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,  # row-interleaved planes (packed_rows)
    out_ptr,  # [N] in the output dtype ([N / 2] with ACT)
    part_ptr, tickets_ptr,  # split-K partials [SPLITS, N] float32, tickets (split_tickets)
    oq_ptr, od_ptr, os_ptr,  # with ACT and OUT_W: the gated outputs rounded to int8
    N, n_chunks, per_split, stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,  # words per chunk
    G: tl.constexpr,  # fields (sub-blocks) per word
    KW: tl.constexpr,  # chunks in flight (one a warp with num_warps = KW)
    SPLITS: tl.constexpr,  # programs along K (program_id(1)); the last one of a tile adds them
    PREFETCH: tl.constexpr,  # request the next KW chunks before multiplying these
    QX: tl.constexpr,  # round this split's activation chunks here (no launch of their own)
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs (packed_matmul's act)
    PDL: tl.constexpr,  # launched early (gdc): the first chunks load before wait_prev
    INTERPRETED: tl.constexpr,
    OUT_W: tl.constexpr = 0,  # > 0 (16 or 32, with ACT): round the outputs in layout (OUT_W,
    OUT_G: tl.constexpr = 8,  # OUT_G) for the next GEMV (split_tickets.round_gated)
    CM: tl.constexpr = "",  # the weight words' cache modifier and eviction policy (CACHE_HINTS)
    EP: tl.constexpr = "",
    SEP: tl.constexpr = "",  # the scale words' eviction policy
):  # fmt: skip
    launch_next(PDL)
    tile = tl.program_id(0).to(tl.int64)
    rows = tile * ROWS + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    y = row_sums(x_ptr, xq_ptr, xd_ptr, xs_ptr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
                 tile, c0, c1, stride_q, stride_s, stride_d, QTYPE, HI, W, G, KW, PREFETCH, QX,
                 PDL, INTERPRETED, CM, EP, SEP)  # fmt: skip
    last = finish_rows(out_ptr, part_ptr, tickets_ptr, y, rows, N, ROWS, SPLITS, ACT)
    if OUT_W > 0:  # noqa: SIM102 - a compile-time test around a runtime one
        if last:
            round_gated(out_ptr, tickets_ptr, tl.num_programs(0), oq_ptr, od_ptr, os_ptr, ROWS,
                        OUT_W, OUT_G)  # fmt: skip


def launch_int8_rows(x, pw, targets, grid, n_chunks, per_split, cfg, act, interp,
                     int8=None, out_int8=None) -> None:  # fmt: skip
    """gemv_int8_rows_kernel over the interleaved pw for the row x ([K]); targets: (out, split
    partials, tickets) as finish_rows takes them, grid (row tiles of 32, splits); cfg:
    num_warps (= KW, chunks in flight), PREFETCH and QX as packed_int8's; int8: x rounded for
    pw's layout already (xq, xd, xs, e.g. by the RMSNorm that made it: norm.add_rms_norm_int8),
    else a launch rounds it (or the GEMV itself, with QX); out_int8: with act, (xq, xd, xs, W,
    G) buffers the gated outputs are rounded into for the next GEMV (W 16 or 32)."""
    qx = bool(cfg.get("QX")) and int8 is None
    if int8 is not None:
        xq, xd, xs = int8
    else:
        xq, xd, xs = int8_buffers(x, pw) if qx else prepare_int8(x, pw)
    oq, od, os_, out_w, out_g = out_int8 if out_int8 else (xq, xd, xs, 0, 8)
    warps = cfg.get("num_warps", 4)
    cm, ep, sep = CACHE_HINTS[cfg.get("CACHE", DEFAULT_CACHE)]
    early = pdl(x.device, gemv_int8_rows_kernel)
    gemv_int8_rows_kernel[grid](
        x, xq, xd, xs, *planes(pw), *targets, oq, od, os_, pw.shape[0], n_chunks, per_split,
        *strides(pw), **fields(pw), KW=warps, SPLITS=grid[1], PREFETCH=bool(cfg.get("PREFETCH")),
        QX=qx, ACT=act, PDL=early, INTERPRETED=interp, OUT_W=out_w, OUT_G=out_g, CM=cm, EP=ep,
        SEP=sep,
        num_warps=warps, maxnreg=maxnreg(pw.qtype), **launch_kw(early),
    )  # fmt: skip
