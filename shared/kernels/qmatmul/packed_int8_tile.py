"""The int8-activation GEMV over one coalesced tile a program (``INT8: 1, TILE: 1``).

``packed_int8.gemv_int8_kernel`` gives each thread whole chunks of a row (``TPR`` 1-2): a
warp's 128-bit load then touches 32 rows, one sector each, and half of every sector is fetched
again by the next load. ncu on the H200 (BENCHMARKS.md 2026-11-30 (r)): 56-61 % of the L2
sectors were excess, and warps spent 84-86 % of their cycles waiting on those loads (Q4_K
28672 x 4096 at 41 % of DRAM bandwidth).

Here a program loads every word of its rows and split as one tile, ``[BLOCK_N, CH * W]`` int32
(``CH`` chunks, all requested before any is used): adjacent threads read adjacent 16 bytes of
a row, so a warp's load covers whole 128-byte lines. Each thread then owns groups of four words
(``g`` below) and works them as ``packed_int8`` does: a byte transpose gives per field j the
codes of four consecutive elements of sub-block j, one ``dp4a`` multiplies them by their int8
activations, and the int32 sum meets the sub-block's scales in float32 at once (fields of a
group belong to different sub-blocks). The offsets (``shift_j * sum(x)``, once per sub-block and
row) are a separate ``[BLOCK_N, CH, G]`` tile, not work for every group.

Measured on the H200 (BENCHMARKS.md 2026-11-30 (r)): the excess sectors are gone, but the
kernel is L1-bound instead (78.8 % L1/TEX, 27.6 % DRAM at 28672 x 4096): every thread loads its
own groups' activations, activation scales and sub-block scales, about 4.5 bytes of L1 traffic
per weight byte. It lost 16 of 18 batch-1 shapes to ``gemv_int8_kernel`` and is a candidate of
the full tuning only.

Same result as ``gemv_int8_kernel`` up to float32 summation order: the activations are rounded
by the same ``int8_activations.prepare_int8``. Types: ``packed_int8.INT8_TYPES``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.qmatmul.int8_activations import prepare_int8
from shared.kernels.qmatmul.int8_ops import dp4a
from shared.kernels.qmatmul.layout import PackedWeight
from shared.kernels.qmatmul.packed_chunk import Q4_K, Q6_K, Q8_0
from shared.kernels.qmatmul.packed_gemm import fields, planes, strides
from shared.kernels.qmatmul.packed_int8 import _codes, _split4, _split8
from shared.kernels.qmatmul.split_tickets import finish_rows

__all__ = ["gemv_int8_tile_kernel", "launch_int8_tile"]


@triton.jit
def _fields(t, B: tl.constexpr, P: tl.constexpr, G: tl.constexpr):
    """[B, P, G] (G = 4 or 8) -> 8 [B, P] tensors, the last four repeating the first for G 4."""
    if G == 8:
        t0, t1, t2, t3, t4, t5, t6, t7 = _split8(t, B, P)
    else:
        t0, t1, t2, t3 = _split4(t, B, P)
        t4, t5, t6, t7 = t0, t1, t2, t3
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _scales(
    QTYPE: tl.constexpr, HI: tl.constexpr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows_s, rows_d, c,
    live, G: tl.constexpr,
):  # fmt: skip
    """The factors of weight = ``fa * sa_j * q - fb * sb_j`` for rows (``rows_s`` / ``rows_d``:
    their offsets in the sub-block and d planes, [B, 1]) and chunks c ([1, X], live where they
    exist): sa, sb [B, X, G] per sub-block j, fa, fb [B, X]."""
    at = (rows_s + c * G)[:, :, None] + tl.arange(0, G)[None, None, :]
    live3 = live[:, :, None]
    one = tl.zeros_like(rows_d + c).to(tl.float32) + 1.0  # [B, X]
    if QTYPE == Q8_0:  # d per sub-block; no offset
        sa = tl.load(d_ptr + at, mask=live3, other=0).to(tl.float32)
        sb, fa, fb = sa, one, one * 0.0
    elif QTYPE == Q6_K:  # d * sc * (q - 32); d per 256 = two chunks
        sa = tl.load(sc_ptr + at, mask=live3, other=0).to(tl.float32)
        fa = tl.load(d_ptr + rows_d + c // 2, mask=live, other=0).to(tl.float32)
        sb, fb = sa, 32.0 * fa
    elif QTYPE >= Q4_K:  # d * sc * q - dmin * mn
        sa = tl.load(sc_ptr + at, mask=live3, other=0).to(tl.float32)
        sb = tl.load(mn_ptr + at, mask=live3, other=0).to(tl.float32)
        fa = tl.load(d_ptr + rows_d + c, mask=live, other=0).to(tl.float32)
        fb = tl.load(dmin_ptr + rows_d + c, mask=live, other=0).to(tl.float32)
    else:  # legacy: d (and m) per block of 32: d * (q - bias) or d * q + m
        sa = tl.load(d_ptr + at, mask=live3, other=0).to(tl.float32)
        fa = one
        if QTYPE % 2 == 1:
            sb, fb = tl.load(mn_ptr + at, mask=live3, other=0).to(tl.float32), -one
        else:
            sb, fb = sa, one * (16.0 if HI else 8.0)
    return sa, sb, fa, fb


@triton.jit
def gemv_int8_tile_kernel(
    xq_ptr, xd_ptr, xs_ptr,  # int8_activations' output for the weight's (W, G)
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr, part_ptr, tickets_ptr,  # as gemv_int8_kernel's
    N, n_chunks, per_split, stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,  # words per chunk
    G: tl.constexpr,  # fields (sub-blocks) per word
    BLOCK_N: tl.constexpr,
    CH: tl.constexpr,  # chunks in the tile: per_split rounded up to a power of two
    SPLITS: tl.constexpr,
    ACT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    A: tl.constexpr = W // 4  # groups of four words a chunk
    P: tl.constexpr = CH * A  # groups a row in the tile
    S: tl.constexpr = QTYPE == Q8_0  # signed codes
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, N - 1)[:, None]  # rows past N read row N - 1, never stored
    c0 = tl.program_id(1) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    g = tl.arange(0, P)[None, :]  # [1, P]
    c = c0 + g // A  # each group's chunk
    live = c < c1
    # every quant of the tile in one request: [B, P, 4], a row's words contiguous
    base = safe * stride_q + c0 * W + 4 * g  # [B, P]: word index of each group
    words = tl.load(
        q_ptr + base[:, :, None] + tl.arange(0, 4)[None, None, :], mask=live[:, :, None], other=0
    )
    hi = base
    if QTYPE == Q6_K:  # four int16 entries a group: one 64-bit load
        hi = tl.load(hi_ptr.to(tl.pointer_type(tl.int64)) + base // 4, mask=live, other=0)
    elif HI:  # four uint8 entries: one 32-bit load
        hi = tl.load(hi_ptr.to(tl.pointer_type(tl.int32)) + base // 4, mask=live, other=0)
    # the activations of each group: words xq[group, j] (quantize_x_kernel's layout)
    gx = (c0 * A + g)[:, :, None] * G + tl.arange(0, G)[None, None, :]  # [1, P, G]
    xw = tl.load(xq_ptr + gx, mask=live[:, :, None], other=0)
    xd = tl.load(xd_ptr + (c * G)[:, :, None] + tl.arange(0, G)[None, None, :],
                 mask=live[:, :, None], other=0.0)  # fmt: skip
    # the scales of each group's chunk: [B, P, G] (threads of one chunk read the same ones)
    rows_s, rows_d = safe * stride_s, safe * stride_d
    sa, _, fa, _ = _scales(QTYPE, HI, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows_s, rows_d, c, live, G)
    n0, n1, n2, n3, n4, n5, n6, n7 = _codes(QTYPE, HI, words, hi, BLOCK_N, P, INTERPRETED)
    x0, x1, x2, x3, x4, x5, x6, x7 = _fields(xw, 1, P, G)
    coef = sa * xd  # [B, P, G]: scale times the activations' scale, per sub-block
    k0, k1, k2, k3, k4, k5, k6, k7 = _fields(coef, BLOCK_N, P, G)
    zero = tl.zeros((BLOCK_N, P), dtype=tl.int32)
    part = k0 * dp4a(n0, x0, zero, S, INTERPRETED).to(tl.float32)
    part += k1 * dp4a(n1, x1, zero, S, INTERPRETED).to(tl.float32)
    part += k2 * dp4a(n2, x2, zero, S, INTERPRETED).to(tl.float32)
    part += k3 * dp4a(n3, x3, zero, S, INTERPRETED).to(tl.float32)
    if G == 8:
        part += k4 * dp4a(n4, x4, zero, S, INTERPRETED).to(tl.float32)
        part += k5 * dp4a(n5, x5, zero, S, INTERPRETED).to(tl.float32)
        part += k6 * dp4a(n6, x6, zero, S, INTERPRETED).to(tl.float32)
        part += k7 * dp4a(n7, x7, zero, S, INTERPRETED).to(tl.float32)
    y = tl.sum(part * fa, axis=1)
    if QTYPE != Q8_0:  # the offsets, once per sub-block and row: a [B, CH, G] tile of their own
        cc = c0 + tl.arange(0, CH)[None, :]
        on = cc < c1
        _, sb, _, fb = _scales(
            QTYPE, HI, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows_s, rows_d, cc, on, G
        )  # fmt: skip
        xs = tl.load(xs_ptr + (cc * G)[:, :, None] + tl.arange(0, G)[None, None, :],
                     mask=on[:, :, None], other=0.0)  # fmt: skip
        y -= tl.sum(tl.sum(sb * xs, axis=2) * fb, axis=1)
    finish_rows(out_ptr, part_ptr, tickets_ptr, y, rows, N, BLOCK_N, SPLITS, ACT)


def launch_int8_tile(x, pw: PackedWeight, targets, grid, n_chunks, per_split, cfg, act, interp):
    """gemv_int8_tile_kernel over pw for the row x ([K]); arguments as packed_int8.launch_int8
    (cfg: BLOCK_N, num_warps)."""
    xq, xd, xs = prepare_int8(x, pw)
    gemv_int8_tile_kernel[grid](
        xq, xd, xs, *planes(pw), *targets, pw.shape[0], n_chunks, per_split, *strides(pw),
        **fields(pw), BLOCK_N=cfg["BLOCK_N"], CH=triton.next_power_of_2(per_split),
        SPLITS=grid[1], ACT=act, INTERPRETED=interp, num_warps=cfg.get("num_warps", 4),
    )  # fmt: skip
