"""The int8-activation packed GEMV (M = 1, ``INT8: 1``): integer dot products on ``dp4a``.

The float GEMVs (``packed_gemv_plain.gemv_kernel``, ``packed_gemv``) turn every 4-bit code into a
float and multiply it by its activation: 5-9 instructions a weight on sm_90, and at batch 1 the
H200 ran out of issue slots long before it ran out of memory bandwidth (ncu: 0.65 issued warps
a scheduler, 22 % of DRAM). Here, as llama.cpp's MMVQ does, the activations are quantized to
int8 first (``int8_activations``: one scale per sub-block of the weight's layout, round to
nearest, plus the float sum of each sub-block for the offsets; a launch of its own, or with
``QX`` in the GEMV's prologue) and one ``dp4a`` multiplies four codes by four activations and
adds them to an int32:

- ``TPR`` threads share a weight row (``BLOCK_N`` rows a program), each reading every TPR-th
  group of four words of a chunk (128-bit loads; more threads a row coalesce, fewer scale
  fewer sub-blocks). In the packed layout field j of word i is element ``W*j + i``, so a byte
  transpose of the four words (``int8_ops.transpose4``) yields, per field, the codes of four
  consecutive elements of one sub-block: nibbles after a mask (plus the fifth bit or the Q6_K
  high pair OR-ed in), bytes as they are for Q8_0. Their activations are one int8 word.
- per sub-block j the int32 sum meets the scales once:
  ``scale_j * dx_j * sum(q * xq) - shift_j * sum(x)`` with weight = ``q * scale - shift``.
- a chunk's loads are issued together (``_load``), its math follows (``_compute``); with
  ``PREFETCH`` chunk c + 1 is requested before chunk c is multiplied.

Measured on the H200 (BENCHMARKS.md, 2026-11-30 (b), (r)): 1.0-1.5x the float GEMV for Q4_K
and Q6_K, not for Q8_0; 0.22-0.55 of the copy bandwidth, PREFETCH the fastest on most 8B
shapes. ncu (r): warps wait on loads that fetch each sector twice (a warp's 128-bit load
touches 32 rows). On CUDA the int8 types now keep row-interleaved planes and batch 1 runs
``packed_int8_rows`` (1.07-2.31x faster on the Q4_K 8B shapes, (t)); this kernel serves the
plain planes (a layer off CUDA keeps them).

The result is ``x_hat @ unpack(pw).T`` plus the offsets' exact part, where x_hat is x rounded to
int8 per sub-block: not the float GEMV's result, but within the error bound of that rounding
(tests/test_kernel_packed_int8.py asserts the bound). Types: the 4/5-bit ones (Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K), Q6_K and Q8_0; Q2_K / Q3_K keep the float GEMV.
"""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from shared.kernels.qmatmul.int8_activations import int8_buffers, prepare_int8, quantize_chunk
from shared.kernels.qmatmul.int8_ops import dp4a, even_odd, transpose4
from shared.kernels.qmatmul.layout import WORDS
from shared.kernels.qmatmul.packed_chunk import Q4_K, Q6_K, Q8_0
from shared.kernels.qmatmul.packed_gemm import fields, planes, strides
from shared.kernels.qmatmul.split_tickets import finish_rows

__all__ = ["gemv_int8_kernel", "launch_int8"]

_T = GGMLQuantizationType
_NIB = tl.constexpr(0x0F0F0F0F)


@triton.jit
def _split4(t, B: tl.constexpr, P: tl.constexpr):
    """[B, P, 4] -> its four [B, P] slices along the last axis."""
    e, o = tl.split(tl.reshape(t, (B, P, 2, 2)))
    t0, t2 = tl.split(e)
    t1, t3 = tl.split(o)
    return t0, t1, t2, t3


@triton.jit
def _split8(t, B: tl.constexpr, P: tl.constexpr):
    """[B, P, 8] -> its eight [B, P] slices along the last axis."""
    e, o = tl.split(tl.reshape(t, (B, P, 4, 2)))
    t0, t2, t4, t6 = _split4(e, B, P)
    t1, t3, t5, t7 = _split4(o, B, P)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _row_entries(ptr, at, live, N: tl.constexpr, B: tl.constexpr, P: tl.constexpr):
    """The N consecutive entries at ptr + at ([B, 1]: one offset a row) for each of the P
    threads of a row -> [B, P, N] (the threads of a row read the same ones)."""
    offs = tl.broadcast_to(at[:, :, None] + tl.arange(0, N)[None, None, :], (B, P, N))
    return tl.load(ptr + offs, mask=live, other=0)


@triton.jit
def _parts(t, B: tl.constexpr, P: tl.constexpr, NG: tl.constexpr):
    """[B, P, NG] (NG = 1, 2, 4 or 8) -> 8 [B, P] tensors: entries 0 .. NG - 1 of the last axis
    in order, the rest repeats (pure register moves: every thread holds its last axis)."""
    if NG == 1:
        g0 = tl.reshape(t, (B, P))
        g1, g2, g3, g4, g5, g6, g7 = g0, g0, g0, g0, g0, g0, g0
    elif NG == 2:
        g0, g1 = tl.split(t)
        g2, g3, g4, g5, g6, g7 = g0, g1, g0, g1, g0, g1
    elif NG == 4:
        g0, g1, g2, g3 = _split4(t, B, P)
        g4, g5, g6, g7 = g0, g1, g2, g3
    else:
        g0, g1, g2, g3, g4, g5, g6, g7 = _split8(t, B, P)
    return g0, g1, g2, g3, g4, g5, g6, g7


@triton.jit
def _groups(t, B: tl.constexpr, P: tl.constexpr, NG: tl.constexpr):
    """[B, P, 4, NG] -> 8 [B, P, 4] tensors, as _parts along the last axis."""
    g0, g1, g2, g3, g4, g5, g6, g7 = _parts(tl.reshape(t, (B, P * 4, NG)), B, P * 4, NG)
    return (
        tl.reshape(g0, (B, P, 4)), tl.reshape(g1, (B, P, 4)), tl.reshape(g2, (B, P, 4)),
        tl.reshape(g3, (B, P, 4)), tl.reshape(g4, (B, P, 4)), tl.reshape(g5, (B, P, 4)),
        tl.reshape(g6, (B, P, 4)), tl.reshape(g7, (B, P, 4)),
    )  # fmt: skip


@triton.jit
def _load(
    QTYPE: tl.constexpr, HI: tl.constexpr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    rows, c, live, stride_q, stride_s, stride_d, W: tl.constexpr, G: tl.constexpr,
    B: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """Every load of chunk c (masked by `live`): the thread's groups of four words
    [B, P, NG, 4], their high-bit entries [B, P, NG], the per-sub-block scale and offset
    entries [B, P, G] and the per-row factors [B, 1, 1]. Issued together, so a kernel can
    request chunk c + 1 before it multiplies chunk c."""
    NG: tl.constexpr = W // 4 // P
    p = tl.arange(0, P)[None, :, None]
    g = tl.arange(0, NG)[None, None, :]
    base = rows[:, :, None] * stride_q + c * W + 4 * (p + P * g)  # [B, P, NG]
    words = tl.load(
        q_ptr + base[:, :, :, None] + tl.arange(0, 4)[None, None, None, :], mask=live, other=0
    )
    hi = base  # (no high plane: never read)
    if QTYPE == Q6_K:  # four int16 entries of the group: one 64-bit load
        hi = tl.load(hi_ptr.to(tl.pointer_type(tl.int64)) + base // 4, mask=live, other=0)
    elif HI:  # four uint8 entries: one 32-bit load
        hi = tl.load(hi_ptr.to(tl.pointer_type(tl.int32)) + base // 4, mask=live, other=0)
    at = rows * stride_s + c * G
    one = tl.full((B, 1, 1), 1.0, dtype=tl.float32)
    if QTYPE == Q8_0:  # d per sub-block; weight = q * d
        sa = _row_entries(d_ptr, at, live, G, B, P).to(tl.float32)
        sb, fa, fb = sa, one, one * 0.0
    elif QTYPE == Q6_K:  # weight = d * sc * (q - 32)
        sa = _row_entries(sc_ptr, at, live, G, B, P).to(tl.float32)
        d = tl.load(d_ptr + rows * stride_d + c // 2, mask=live, other=0).to(tl.float32)
        sb, fa, fb = sa, d[:, :, None], 32.0 * d[:, :, None]
    elif QTYPE >= Q4_K:  # weight = d * sc * q - dmin * mn
        sa = _row_entries(sc_ptr, at, live, G, B, P).to(tl.float32)
        sb = _row_entries(mn_ptr, at, live, G, B, P).to(tl.float32)
        d = tl.load(d_ptr + rows * stride_d + c, mask=live, other=0).to(tl.float32)
        dmin = tl.load(dmin_ptr + rows * stride_d + c, mask=live, other=0).to(tl.float32)
        fa, fb = d[:, :, None], dmin[:, :, None]
    else:  # legacy: d (and m) per block of 32; weight d * (q - bias) or d * q + m
        sa = _row_entries(d_ptr, at, live, G, B, P).to(tl.float32)
        if QTYPE % 2 == 1:
            sb, fa, fb = _row_entries(mn_ptr, at, live, G, B, P).to(tl.float32), one, -one
        elif HI:
            sb, fa, fb = sa, one, one * 16.0
        else:
            sb, fa, fb = sa, one, one * 8.0
    return words, hi, sa, sb, fa, fb


@triton.jit
def _codes(QTYPE: tl.constexpr, HI: tl.constexpr, w4, h, B: tl.constexpr, P: tl.constexpr,
           INTERPRETED: tl.constexpr):  # fmt: skip
    """A group's four words [B, P, 4] (and high entries [B, P]) -> per field j a word of four
    codes (byte t: word t's field j)."""
    w0, w1, w2, w3 = _split4(w4, B, P)
    b0, b1, b2, b3 = transpose4(w0, w1, w2, w3, INTERPRETED)
    if QTYPE == Q8_0:
        return b0, b1, b2, b3, b0, b1, b2, b3
    n0, n1, n2, n3 = b0 & _NIB, (b0 >> 4) & _NIB, b1 & _NIB, (b1 >> 4) & _NIB
    n4, n5, n6, n7 = b2 & _NIB, (b2 >> 4) & _NIB, b3 & _NIB, (b3 >> 4) & _NIB
    if QTYPE == Q6_K:  # int16 plane: bits 2j, 2j + 1 of half-word t -> bits 4, 5 of byte t
        e0, e1 = even_odd(h.to(tl.int32), (h >> 32).to(tl.int32), INTERPRETED)
        m = 0x30303030
        n0, n1, n2, n3 = (
            n0 | ((e0 << 4) & m),
            n1 | ((e0 << 2) & m),
            n2 | (e0 & m),
            n3 | ((e0 >> 2) & m),
        )
        n4, n5, n6, n7 = (
            n4 | ((e1 << 4) & m),
            n5 | ((e1 << 2) & m),
            n6 | (e1 & m),
            n7 | ((e1 >> 2) & m),
        )
    elif HI:  # uint8 plane: bit j of byte t -> bit 4 of byte t of field j
        m = 0x10101010
        n0, n1, n2, n3 = (
            n0 | ((h << 4) & m),
            n1 | ((h << 3) & m),
            n2 | ((h << 2) & m),
            n3 | ((h << 1) & m),
        )
        n4, n5, n6, n7 = n4 | (h & m), n5 | ((h >> 1) & m), n6 | ((h >> 2) & m), n7 | ((h >> 3) & m)
    return n0, n1, n2, n3, n4, n5, n6, n7  # fmt: skip


@triton.jit
def _field(acc, add, isum, scale, shift, xd_ptr, xs_ptr, c, J: tl.constexpr, G: tl.constexpr,
           OFFSET: tl.constexpr):  # fmt: skip
    """Sub-block J: acc += scale * dx * isum, add += shift * sum(x) (when OFFSET)."""
    acc += scale * (tl.load(xd_ptr + c * G + J) * isum.to(tl.float32))
    if OFFSET:
        add += shift * tl.load(xs_ptr + c * G + J)
    return acc, add


@triton.jit
def _compute(
    acc, c, loaded, xq_ptr, xd_ptr, xs_ptr, QTYPE: tl.constexpr, HI: tl.constexpr,
    W: tl.constexpr, G: tl.constexpr, B: tl.constexpr, P: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """acc [B, P] += chunk c's part of each thread's share of its row's dot product."""
    NG: tl.constexpr = W // 4 // P
    S: tl.constexpr = QTYPE == Q8_0  # signed codes
    OFFSET: tl.constexpr = QTYPE != Q8_0
    words, hi, sa, sb, fa, fb = loaded
    groups = _groups(tl.permute(words, (0, 1, 3, 2)), B, P, NG)
    highs = _parts(hi, B, P, NG)
    p = tl.arange(0, P)[None, :]
    i0 = tl.zeros((B, P), dtype=tl.int32)
    i1, i2, i3, i4, i5, i6, i7 = i0, i0, i0, i0, i0, i0, i0
    for s in tl.static_range(NG):
        n0, n1, n2, n3, n4, n5, n6, n7 = _codes(QTYPE, HI, groups[s], highs[s], B, P, INTERPRETED)
        at = (c * (W // 4) + p + P * s) * G  # [1, P]: the group's activation words
        x0, x1, x2, x3 = _split4(_row_entries(xq_ptr, at, True, 4, B, P), B, P)
        i0, i1 = dp4a(n0, x0, i0, S, INTERPRETED), dp4a(n1, x1, i1, S, INTERPRETED)
        i2, i3 = dp4a(n2, x2, i2, S, INTERPRETED), dp4a(n3, x3, i3, S, INTERPRETED)
        if G == 8:
            x4, x5, x6, x7 = _split4(_row_entries(xq_ptr, at + 4, True, 4, B, P), B, P)
            i4, i5 = dp4a(n4, x4, i4, S, INTERPRETED), dp4a(n5, x5, i5, S, INTERPRETED)
            i6, i7 = dp4a(n6, x6, i6, S, INTERPRETED), dp4a(n7, x7, i7, S, INTERPRETED)
    fa2 = tl.reshape(fa, (B, 1))
    fb2 = tl.reshape(fb, (B, 1))
    if G == 8:
        s0, s1, s2, s3, s4, s5, s6, s7 = _split8(sa, B, P)
        t0, t1, t2, t3, t4, t5, t6, t7 = _split8(sb, B, P)
    else:
        s0, s1, s2, s3 = _split4(sa, B, P)
        t0, t1, t2, t3 = _split4(sb, B, P)
        s4, s5, s6, s7, t4, t5, t6, t7 = s0, s1, s2, s3, t0, t1, t2, t3
    part = tl.zeros((B, P), dtype=tl.float32)
    add = tl.zeros((B, P), dtype=tl.float32)
    part, add = _field(part, add, i0, s0, t0, xd_ptr, xs_ptr, c, 0, G, OFFSET)
    part, add = _field(part, add, i1, s1, t1, xd_ptr, xs_ptr, c, 1, G, OFFSET)
    part, add = _field(part, add, i2, s2, t2, xd_ptr, xs_ptr, c, 2, G, OFFSET)
    part, add = _field(part, add, i3, s3, t3, xd_ptr, xs_ptr, c, 3, G, OFFSET)
    if G == 8:
        part, add = _field(part, add, i4, s4, t4, xd_ptr, xs_ptr, c, 4, G, OFFSET)
        part, add = _field(part, add, i5, s5, t5, xd_ptr, xs_ptr, c, 5, G, OFFSET)
        part, add = _field(part, add, i6, s6, t6, xd_ptr, xs_ptr, c, 6, G, OFFSET)
        part, add = _field(part, add, i7, s7, t7, xd_ptr, xs_ptr, c, 7, G, OFFSET)
    # the offsets belong to the row once: the first of its threads adds them
    return acc + fa2 * part - tl.where(p == 0, fb2 * add, 0.0)


@triton.jit
def _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX: tl.constexpr, W: tl.constexpr,
                 G: tl.constexpr):  # fmt: skip
    """With QX: chunks c0 .. c1 - 1 of x rounded to int8 into the program's (shared) buffers,
    then a barrier, so that every thread of the program reads them. Every program of the split
    stores the same words. (A while loop: the interpreter cannot range() over tensor bounds,
    triton#9171.)"""
    if QX:
        c = c0
        while c < c1:
            quantize_chunk(x_ptr, xq_ptr, xd_ptr, xs_ptr, c, W, G)
            c += 1
        tl.debug_barrier()


@triton.jit
def gemv_int8_kernel(
    x_ptr,  # [K] activations (read only with QX)
    xq_ptr, xd_ptr, xs_ptr,  # the rounded activations (int8_activations) for the weight's (W, G)
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [N] in the output dtype ([N / 2] with ACT)
    part_ptr, tickets_ptr,  # split-K partials [SPLITS, N] float32, tickets (split_tickets)
    N, n_chunks, per_split, stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,  # words per chunk
    G: tl.constexpr,  # fields (sub-blocks) per word
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,  # programs along K (program_id(1)); the last one of a tile adds them
    TPR: tl.constexpr,  # threads a row: each reads every TPR-th group of four words
    PREFETCH: tl.constexpr,  # request chunk c + 1 before multiplying chunk c
    QX: tl.constexpr,  # round this split's activation chunks here (no launch of their own)
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs (packed_matmul's act)
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row N - 1 (in bounds; their results are never stored)
    safe = tl.minimum(rows, N - 1)[:, None]
    c0 = tl.program_id(1) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    acc = tl.zeros((BLOCK_N, TPR), dtype=tl.float32)
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)
        c = c0
        while c < c1:
            cur = _load(
                QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, safe, c, True,
                stride_q, stride_s, stride_d, W, G, BLOCK_N, TPR,
            )  # fmt: skip
            acc = _compute(acc, c, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, BLOCK_N, TPR, True)
            c += 1
    elif not PREFETCH:  # a chunk's loads together, then its math
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)
        for c in range(c0, c1):
            cur = _load(
                QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, safe, c, True,
                stride_q, stride_s, stride_d, W, G, BLOCK_N, TPR,
            )  # fmt: skip
            acc = _compute(
                acc, c, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, BLOCK_N, TPR, False
            )
    else:
        # chunk c + 1's loads are issued before chunk c is multiplied: a thread keeps a whole
        # chunk of loads in flight instead of waiting on each group and on the scales (more
        # registers, fewer warps: the tuner times both)
        cur = _load(
            QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, safe, c0, c0 < c1,
            stride_q, stride_s, stride_d, W, G, BLOCK_N, TPR,
        )  # fmt: skip
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)  # the first loads in flight
        for c in range(c0, c1):
            nxt = _load(
                QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, safe, c + 1,
                c + 1 < c1, stride_q, stride_s, stride_d, W, G, BLOCK_N, TPR,
            )  # fmt: skip
            acc = _compute(
                acc, c, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, BLOCK_N, TPR, False
            )
            cur = nxt
    y = tl.sum(acc, axis=1)
    finish_rows(out_ptr, part_ptr, tickets_ptr, y, rows, N, BLOCK_N, SPLITS, ACT)


def launch_int8(x, pw, targets, grid, n_chunks, per_split, cfg, act, interp) -> None:
    """gemv_int8_kernel over pw for the row x ([K]); targets: (out, split partials, tickets)
    as finish_rows takes them, grid (row tiles, splits); cfg: BLOCK_N, num_warps, TPR
    (threads a row, default 1; at most the groups of four words a chunk has), PREFETCH and QX
    (1: the activations rounded in the GEMV's prologue instead of a launch before it)."""
    qx = bool(cfg.get("QX"))
    xq, xd, xs = int8_buffers(x, pw) if qx else prepare_int8(x, pw)
    tpr = min(cfg.get("TPR", 1), WORDS[pw.qtype] // 4)
    prefetch = bool(cfg.get("PREFETCH"))
    gemv_int8_kernel[grid](
        x, xq, xd, xs, *planes(pw), *targets, pw.shape[0], n_chunks, per_split, *strides(pw),
        **fields(pw), BLOCK_N=cfg["BLOCK_N"], SPLITS=grid[1], TPR=tpr, PREFETCH=prefetch,
        QX=qx, ACT=act, INTERPRETED=interp, num_warps=cfg.get("num_warps", 4),
    )  # fmt: skip
