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
from shared.kernels.qmatmul.layout import ROWS as _ROWS
from shared.kernels.qmatmul.layout import ROWS_TYPES
from shared.kernels.qmatmul.norm_ahead import (
    load_sums,
    norm_rows,
    rms_scale,
    row_slice,
    sums_block,
)
from shared.kernels.qmatmul.packed_chunk import Q8_0
from shared.kernels.qmatmul.packed_gemm import fields, planes, strides
from shared.kernels.qmatmul.packed_int8 import _codes, _round_split
from shared.kernels.qmatmul.packed_int8_rows_loads import fetch, scale_pair
from shared.kernels.qmatmul.packed_int8_rows_policy import WEIGHT_HINTS, late_next, register_cap
from shared.kernels.qmatmul.qkv_rope import finish_qkv_rope, no_rope_args, qkv_angles
from shared.kernels.qmatmul.split_tickets import (
    finish_rows,
    release_tile,
    round_gated,
    store_rows,
    tile_sums,
)

__all__ = ["ROWS_TYPES", "epilogue_args", "gemv_int8_rows_kernel", "launch_int8_rows", "row_sums"]

ROWS = tl.constexpr(_ROWS)


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
    a, b = scale_pair(QTYPE, J0, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n0, shape), x0, d0, s0, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    a, b = scale_pair(QTYPE, J0 + 1, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n1, shape), x1, d1, s1, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    a, b = scale_pair(QTYPE, J0 + 2, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n2, shape), x2, d2, s2, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    a, b = scale_pair(QTYPE, J0 + 3, a0, a1, b0, b1)
    part, add = _field(part, add, tl.reshape(n3, shape), x3, d3, s3, a, b, S, OFFSET,
                       INTERPRETED)  # fmt: skip
    return part, add


@triton.jit
def unpack(loaded, QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, KW: tl.constexpr,
           INTERPRETED: tl.constexpr):  # fmt: skip
    """fetch's loads -> (the codes of the eight fields, [32, KW * NG] words of four; the scale
    words): what every activation row multiplies."""
    NG: tl.constexpr = W // 4
    words, hi, meta = loaded
    w4 = tl.reshape(words, (ROWS, KW * NG, 4))
    codes = _codes(QTYPE, HI, w4, tl.reshape(hi, (ROWS, KW * NG)), ROWS, KW * NG, INTERPRETED)
    return codes, meta


@triton.jit
def accumulate(acc, cb, c1, codes, meta, xq_ptr, xd_ptr, xs_ptr, QTYPE: tl.constexpr,
               W: tl.constexpr, G: tl.constexpr, KW: tl.constexpr,
               INTERPRETED: tl.constexpr):  # fmt: skip
    """acc [32, KW] += the chunks' parts of the rows' dot products with one activation row
    (its rounding xq, xd, xs), from unpack's codes and scale words."""
    NG: tl.constexpr = W // 4
    S: tl.constexpr = QTYPE == Q8_0  # signed codes
    OFFSET: tl.constexpr = QTYPE != Q8_0
    n0, n1, n2, n3, n4, n5, n6, n7 = codes
    a0, a1, b0, b1, fa, fb = meta
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
def _compute(acc, cb, c1, loaded, xq_ptr, xd_ptr, xs_ptr, QTYPE: tl.constexpr, HI: tl.constexpr,
             W: tl.constexpr, G: tl.constexpr, KW: tl.constexpr,
             INTERPRETED: tl.constexpr):  # fmt: skip
    """acc [32, KW] += the chunks' parts of the rows' dot products."""
    codes, meta = unpack(loaded, QTYPE, HI, W, KW, INTERPRETED)
    return accumulate(acc, cb, c1, codes, meta, xq_ptr, xd_ptr, xs_ptr, QTYPE, W, G, KW,
                      INTERPRETED)  # fmt: skip


@triton.jit
def row_sums(x_ptr, xq_ptr, xd_ptr, xs_ptr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile,
             c0, c1, stride_q, stride_s, stride_d, QTYPE: tl.constexpr, HI: tl.constexpr,
             W: tl.constexpr, G: tl.constexpr, KW: tl.constexpr, PREFETCH: tl.constexpr,
             QX: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr, CM: tl.constexpr,
             EP: tl.constexpr, SEP: tl.constexpr, sums_ptr, norm_k, norm_eps,
             NORM_BLOCK: tl.constexpr, early_ptr, rows, N, EARLY: tl.constexpr):  # fmt: skip
    """The 32 rows' dot products over chunks c0 .. c1 - 1 of row tile `tile` ([32] float32):
    the first chunks' weights requested before ``wait_prev`` (PDL), the activations after it
    (rounded here first with QX). Arguments as gemv_int8_rows_kernel's. NORM_BLOCK > 0: the
    activations are ``h * w`` rounded by the GEMV before (``norm_ahead``), whose row of norm_k
    the tile sums at sums_ptr give ``rstd``: loaded with the activations, the sums scaled by
    it at the end. EARLY: (the sums, early_ptr's entries at rows below N, loaded with the
    activations, float32), else (the sums, the sums)."""
    acc = tl.zeros((ROWS, KW), dtype=tl.float32)
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        if NORM_BLOCK > 0:
            sums = load_sums(sums_ptr, norm_k, NORM_BLOCK)
        if EARLY:
            early = row_slice(early_ptr, rows, N, True)
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)
        cb = c0
        while cb < c1:
            cur = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb, c1,
                        stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            acc = _compute(acc, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, True)
            cb += KW
    elif not PREFETCH:
        # the first chunks' weights load while the previous kernel ends (PDL); the rest as a loop
        cur = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, c0, c1,
                    stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
        wait_prev(PDL)
        if NORM_BLOCK > 0:
            sums = load_sums(sums_ptr, norm_k, NORM_BLOCK)
        if EARLY:
            early = row_slice(early_ptr, rows, N, True)
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)
        acc = _compute(acc, c0, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, False)
        for cb in range(c0 + KW, c1, KW):
            cur = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb, c1,
                        stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            acc = _compute(acc, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, False)
    else:
        cur = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, c0, c1,
                    stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
        wait_prev(PDL)
        if NORM_BLOCK > 0:
            sums = load_sums(sums_ptr, norm_k, NORM_BLOCK)
        if EARLY:
            early = row_slice(early_ptr, rows, N, True)
        _round_split(x_ptr, xq_ptr, xd_ptr, xs_ptr, c0, c1, QX, W, G)  # the first loads in flight
        for cb in range(c0, c1, KW):
            nxt = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb + KW,
                        c1, stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            acc = _compute(acc, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, QTYPE, HI, W, G, KW, False)
            cur = nxt
    y = tl.sum(acc, axis=1)
    if NORM_BLOCK > 0:
        y = y * rms_scale(sums, norm_k, norm_eps)
    if EARLY:
        return y, early
    return y, y


@triton.jit
def gemv_int8_rows_kernel(
    x_ptr,  # [K] activations (read only with QX)
    xq_ptr, xd_ptr, xs_ptr,  # the rounded activations (int8_activations) for the weight's (W, G)
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,  # row-interleaved planes (packed_rows)
    out_ptr,  # [N] in the output dtype ([N / 2] with ACT)
    part_ptr, tickets_ptr,  # split-K partials [SPLITS, N] float32, tickets (split_tickets)
    oq_ptr, od_ptr, os_ptr,  # with OUT_W: the gated (ACT) or normed (NORM_OUT) outputs in int8
    oq2_ptr, od2_ptr, os2_ptr,  # with NORM_OUT and OUT_W2: the normed outputs, a second layout
    res_ptr, hres_ptr, nw_ptr, nsums_ptr,  # NORM_OUT: residual in, out + residual, norm weight,
    sums_ptr, norm_k, norm_eps,  # the tiles' sums of squares; NORM_BLOCK: x's (norm_ahead)
    pos_ptr, slot_ptr, kc_ptr, vc_ptr, ff_ptr, row0, q_dim, kv_dim, rope_scale, rope_step,  # ROPE
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
    CM: tl.constexpr = "",  # the weight words' cache modifier and eviction policy (WEIGHT_HINTS)
    EP: tl.constexpr = "",
    SEP: tl.constexpr = "",  # the scale words' eviction policy
    ROPE: tl.constexpr = False,  # Q/K/V rows: RoPE and the KV-cache write here (qkv_rope)
    HEAD_DIM: tl.constexpr = 128,
    ROPE_DIM: tl.constexpr = 128,
    HAS_FF: tl.constexpr = False,
    LATE_NEXT: tl.constexpr = False,  # launch_next after the weight loop, not first (late_next)
    NORM_BLOCK: tl.constexpr = 0,  # > 0: the activations await the norm's scale (norm_ahead)
    NORM_OUT: tl.constexpr = False,  # the output plus the residual normed and rounded in layout
    OUT_W2: tl.constexpr = 0,  # (OUT_W, OUT_G) and with OUT_W2 (OUT_W2, OUT_G2) (norm_ahead)
    OUT_G2: tl.constexpr = 8,
):  # fmt: skip
    if not LATE_NEXT:
        launch_next(PDL)
    tile = tl.program_id(0).to(tl.int64)
    rows = tile * ROWS + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    if ROPE:
        cos, sin = qkv_angles(pos_ptr, ff_ptr, row0, rows, rope_scale, rope_step, ROWS, HEAD_DIM,
                              ROPE_DIM, HAS_FF)  # fmt: skip
    # NORM_OUT: the norm weight (a constant) before the weights, the residual with the
    # activations after the wait, so that the last program's epilogue waits for no load of its own
    if NORM_OUT:
        nw = row_slice(nw_ptr, rows, N)
    y, r = row_sums(x_ptr, xq_ptr, xd_ptr, xs_ptr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr,
                    dmin_ptr, tile, c0, c1, stride_q, stride_s, stride_d, QTYPE, HI, W, G, KW,
                    PREFETCH, QX, PDL, INTERPRETED, CM, EP, SEP, sums_ptr, norm_k, norm_eps,
                    NORM_BLOCK, res_ptr, rows, N, NORM_OUT)  # fmt: skip
    if LATE_NEXT:
        launch_next(PDL)
    if ROPE:  # (no ACT: OUT_W is 0)
        finish_qkv_rope(out_ptr, part_ptr, tickets_ptr, y, rows, N, cos, sin, slot_ptr, kc_ptr,
                        vc_ptr, row0, q_dim, kv_dim, ROWS, SPLITS, HEAD_DIM, ROPE_DIM,
                        INTERPRETED)  # fmt: skip
    elif NORM_OUT:  # (no ACT) the tile's results, then the norm's work on them
        last, acc = tile_sums(part_ptr, tickets_ptr, y, rows, N, ROWS, SPLITS)
        if last:
            store_rows(out_ptr, acc, rows, N, ROWS, 0)
            norm_rows(acc, r, nw, rows, N, out_ptr.dtype.element_ty, hres_ptr, nsums_ptr, oq_ptr,
                      od_ptr, os_ptr, OUT_W, OUT_G, oq2_ptr, od2_ptr, os2_ptr, OUT_W2,
                      OUT_G2)  # fmt: skip
            release_tile(tickets_ptr, SPLITS)
    else:
        last = finish_rows(out_ptr, part_ptr, tickets_ptr, y, rows, N, ROWS, SPLITS, ACT)
    if OUT_W > 0 and not NORM_OUT:  # noqa: SIM102 - a compile-time test around a runtime one
        if last:
            round_gated(out_ptr, tickets_ptr, tl.num_programs(0), oq_ptr, od_ptr, os_ptr, ROWS,
                        OUT_W, OUT_G)  # fmt: skip


def launch_int8_rows(x, pw, targets, grid, n_chunks, per_split, cfg, act, interp,
                     int8=None, out_int8=None, rope=None, norm_out=None) -> None:  # fmt: skip
    """gemv_int8_rows_kernel over the interleaved pw for the row x ([K]); targets: (out, split
    partials, tickets) as finish_rows takes them, grid (row tiles of 32, splits); cfg: num_warps
    (= KW, chunks in flight), PREFETCH and QX as packed_int8's, MAXNREG (a register cap other
    than maxnreg's); int8: x rounded for pw's layout already (xq, xd, xs, e.g. by the RMSNorm
    that made it: norm.add_rms_norm_int8; or five, (xq, xd, xs, sums, eps): ``h * w`` awaiting
    the norm's scale, ``norm_ahead``), else a launch rounds it (or the GEMV itself, with QX);
    out_int8: with act, (xq, xd, xs, W, G) buffers the gated outputs are rounded into for
    the next GEMV (W 16 or 32); rope: (``qkv_rope.QKVRope``, the fused Q/K/V row of pw's row
    0) for Q/K/V rows whose epilogue rotates q and k and writes k and v to the cache (without
    act); norm_out (``norm_ahead.NormOut``, without act or rope): the output plus its residual
    normed and rounded for the next GEMVs here."""
    qx = bool(cfg.get("QX")) and int8 is None
    if int8 is not None:
        xq, xd, xs = int8[:3]
    else:
        xq, xd, xs = int8_buffers(x, pw) if qx else prepare_int8(x, pw)
    if rope is not None and act:
        raise ValueError("launch_int8_rows: the RoPE epilogue is for Q/K/V rows, not gate/up")
    if norm_out is not None and (act or rope is not None):
        raise ValueError("launch_int8_rows: norm_out is for plain rows (no act or rope)")
    warps = cfg.get("num_warps", 4)
    cm, ep, sep = WEIGHT_HINTS
    early = pdl(x.device, gemv_int8_rows_kernel)
    rope_args = rope[0].kernel_args(rope[1]) if rope else no_rope_args(targets[0])
    ends, ends_kw = epilogue_args(xq, int8, out_int8, norm_out, pw.shape[1])
    gemv_int8_rows_kernel[grid](
        x, xq, xd, xs, *planes(pw), *targets, *ends, *rope_args, pw.shape[0], n_chunks,
        per_split, *strides(pw), **fields(pw), KW=warps, SPLITS=grid[1],
        PREFETCH=bool(cfg.get("PREFETCH")), QX=qx, ACT=act, PDL=early, INTERPRETED=interp,
        CM=cm, EP=ep, SEP=sep, **(rope[0].constexprs() if rope else {}),
        LATE_NEXT=late_next(rope is not None, pw.qtype),
        num_warps=warps, maxnreg=register_cap(cfg, pw.qtype), **ends_kw, **launch_kw(early),
    )  # fmt: skip


def epilogue_args(xq, int8, out_int8, norm_out, k: int) -> tuple[list, dict]:
    """gemv_int8_rows_kernel's arguments from oq_ptr to norm_eps, and their constexprs: the
    gated outputs' rounding (out_int8), or the norm of norm_out, and the pending norm scale of
    int8 (norm_ahead); unused pointers are xq (never read)."""
    rounded = [(xq, xq, xq, 0, 8)] * 2
    res = [xq] * 4
    if out_int8:
        rounded[0] = out_int8
    if norm_out is not None:
        rounded[: len(norm_out.rounded)] = norm_out.rounded
        res = [norm_out.residual, norm_out.new_residual, norm_out.weight, norm_out.sums]
    pending = int8 is not None and len(int8) == 5
    sums, eps = int8[3:] if pending else (xq, 0.0)
    kw = {
        "OUT_W": rounded[0][3], "OUT_G": rounded[0][4], "OUT_W2": rounded[1][3],
        "OUT_G2": rounded[1][4], "NORM_OUT": norm_out is not None,
        "NORM_BLOCK": sums_block(k) if pending else 0,
    }  # fmt: skip
    return [*rounded[0][:3], *rounded[1][:3], *res, sums, k, eps], kw
