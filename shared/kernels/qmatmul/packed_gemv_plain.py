"""The plain packed GEMV (one activation row): every weight formed in float32, then multiplied.

A program owns ``BLOCK_N`` weight rows, forms each chunk's weights (``packed_chunk.group``:
``q * scale - offset``), multiplies them by the activations on the FMA units and keeps a
``[BLOCK_N, W]`` float32 accumulator that is summed once at the end. When the row tiles alone
cannot fill the device the chunk loop is split over a second grid axis (split-K) and the last
program of each row tile adds the float32 partials (``split_tickets``). ``UNROLL``: exactly
that many chunks a program, all their loads issued before the first multiply; otherwise the
next chunk's loads are issued before this one is multiplied. Launched by ``packed_matmul`` for
one row of plain planes without ``INT8`` or ``FACTOR``. Reference: ``x @ unpack(pw).T``
(tests/test_kernel_packed_matmul.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.qmatmul.packed_chunk import group, load_chunk, load_meta
from shared.kernels.qmatmul.split_tickets import finish_rows

__all__ = ["gemv_kernel"]


@triton.jit
def gemv_kernel(
    x_ptr,  # [K] activations
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [N] in the output dtype ([N / 2] with ACT)
    part_ptr, tickets_ptr,  # split-K partials [SPLITS, N] float32, tickets (split_tickets)
    N, n_chunks, per_split, stride_q, stride_s, stride_d,
    magic,  # packed_chunk.MAGIC
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,  # words per chunk
    G: tl.constexpr,  # fields (sub-blocks) per word
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,  # programs along K (program_id(1)); the last one of a tile adds them
    UNROLL: tl.constexpr,  # > 0: exactly this many chunks per program, unrolled (= per_split)
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs; store act(gate) * up ([N / 2])
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    c0 = tl.program_id(1) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    acc = tl.zeros((BLOCK_N, W), dtype=tl.float32)
    if UNROLL > 0:
        # Every load of the program's chunks can be issued before the first multiply.
        for cc in tl.static_range(UNROLL):
            c = c0 + cc
            live = nmask & (c < n_chunks)
            acc = _gemv_chunk(
                acc, c, live, c < n_chunks, x_ptr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr,
                dmin_ptr, rows, stride_q, stride_s, stride_d, magic, QTYPE, HI, W, G,
            )  # fmt: skip
    elif INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        c = c0
        while c < c1:
            acc = _gemv_chunk(
                acc, c, nmask, c >= 0, x_ptr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
                rows, stride_q, stride_s, stride_d, magic, QTYPE, HI, W, G,
            )  # fmt: skip
            c += 1
    else:
        # Prefetch: chunk c + 1's words and scales are requested before chunk c is multiplied,
        # so each program keeps two chunks of loads in flight instead of waiting out every one.
        live = nmask & (c0 < c1)
        w, wh, h = load_chunk(False, HI, q_ptr, hi_ptr, rows, live, c0, stride_q, W)
        s0, s1, m0, m1, d, dmin = load_meta(
            False, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, live, c0, stride_s, stride_d
        )
        for c in range(c0, c1):
            live = nmask & (c + 1 < c1)
            w2, wh2, h2 = load_chunk(False, HI, q_ptr, hi_ptr, rows, live, c + 1, stride_q, W)
            t0, t1, n0, n1, e, emin = load_meta(
                False, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, live, c + 1, stride_s, stride_d
            )
            acc = _gemv_groups(
                acc, c, c < c1, w, wh, h, s0, s1, m0, m1, d, dmin, x_ptr, magic, QTYPE, HI, W, G
            )
            w, wh, h = w2, wh2, h2
            s0, s1, m0, m1, d, dmin = t0, t1, n0, n1, e, emin
    y = tl.sum(acc, axis=1)
    finish_rows(out_ptr, part_ptr, tickets_ptr, y, rows, N, BLOCK_N, SPLITS, ACT)


@triton.jit
def _gemv_chunk(
    acc, c, live, valid, x_ptr, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows,
    stride_q, stride_s, stride_d, mg,
    QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    w, wh, h = load_chunk(False, HI, q_ptr, hi_ptr, rows, live, c, stride_q, W)
    s0, s1, m0, m1, d, dmin = load_meta(
        False, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, live, c, stride_s, stride_d
    )
    return _gemv_groups(
        acc, c, valid, w, wh, h, s0, s1, m0, m1, d, dmin, x_ptr, mg, QTYPE, HI, W, G
    )


@triton.jit
def _gemv_groups(
    acc, c,
    valid,  # whether chunk c exists (its activations may be read)
    w, wh, h, s0, s1, m0, m1, d, dmin, x_ptr, mg,
    QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, W)
    for j in tl.static_range(G):
        val = group(QTYPE, HI, j, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
        xj = tl.load(x_ptr + c * (W * G) + j * W + i, mask=valid & (i < W), other=0.0)
        acc += val * xj.to(tl.float32)[None, :]
    return acc
