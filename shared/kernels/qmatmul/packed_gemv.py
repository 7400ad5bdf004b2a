"""The factored packed GEMV (M = 1): sums ``Q * x`` per sub-block first and scales once.

``packed_gemv_plain.gemv_kernel`` forms every weight (``q * scale - offset``) before multiplying it
by its activation: two multiply-adds an element, and the per-row scales of all sub-blocks a
thread touches are decoded for a handful of elements each. Here a chunk is viewed as
``[BLOCK_N, W / V, V]`` words (V words per thread, adjacent in memory), each field's codes are
multiplied by their activations and summed over the V words inside the thread, and only that
partial sum meets the sub-block's scale: ``A * sum(Q x) - B * sum(x)`` (``packed_chunk.fields``).
The result equals ``x @ unpack(pw).T`` up to float32 summation order.

Triton lays the ``[BLOCK_N, W / V, V]`` tile out with one weight row per thread (threads along
the rows, the words of a row in the thread), so a row's scales are decoded by one thread, not
by every thread holding some of its columns. The activations arrive as float32 with the sums of
every V of them (``prepare_x_kernel``, one small launch): no conversion and no sum per weight.
Offline (``tools/kernel_sass``, sm_90): 4.9 instructions a weight for Q4_K against 9.2 for
``gemv_kernel``, 182 registers for 64 rows on 2 warps.

Selected by ``FACTOR: 1`` in a decode tile config (the tuner times it beside the other GEMV).
Reference: ``x @ unpack(pw).T`` (tests/test_kernel_packed_gemv.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.qmatmul.packed_chunk import fields, load_meta, load_words
from shared.kernels.qmatmul.split_tickets import finish_rows

__all__ = ["gemv_factored_kernel", "prepare_x_kernel"]


@triton.jit
def _load_words(HI: tl.constexpr, q_ptr, hi_ptr, rows, nmask, c, stride_q, W, col):
    """Chunk c of the rows as [BLOCK_N, W / V, V] words."""
    offs = rows[:, None, None] * stride_q + c * W + col
    return load_words(HI, q_ptr, hi_ptr, offs, nmask[:, None, None])


@triton.jit
def _chunk_dot(
    acc, c, valid, w, wh, h, s0, s1, m0, m1, d, dmin, xf_ptr, xs_ptr, col, slot, mg,
    QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr, V: tl.constexpr,
):  # fmt: skip
    for j in tl.static_range(G):
        q, a, b = fields(QTYPE, HI, j, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
        # [1, W / V, V] float32: laid out like the words, so nothing moves between threads
        xj = tl.load(xf_ptr + c * (W * G) + j * W + col, mask=valid & (col < W), other=0.0)
        xs = tl.load(xs_ptr + (c * G + j) * (W // V) + slot, mask=valid & (slot < W), other=0.0)
        part = tl.sum(q * xj, axis=2)  # inside the thread: V words of one row
        acc += a[:, None] * part - b[:, None] * xs
    return acc


@triton.jit
def prepare_x_kernel(x_ptr, xf_ptr, xs_ptr, K, V: tl.constexpr, BLOCK: tl.constexpr):
    """x (any float dtype) -> float32 copy and the sums of every V consecutive entries."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < K, other=0.0).to(tl.float32)
    tl.store(xf_ptr + i, x, mask=i < K)
    g = tl.program_id(0) * (BLOCK // V) + tl.arange(0, BLOCK // V)
    tl.store(xs_ptr + g, tl.sum(tl.reshape(x, (BLOCK // V, V)), axis=1), mask=g * V < K)


@triton.jit
def gemv_factored_kernel(
    xf_ptr,  # [K] float32 activations (prepare_x_kernel)
    xs_ptr,  # [K / V] float32 sums of V consecutive activations
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
    V: tl.constexpr,  # adjacent words a thread sums over
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs (packed_matmul's act)
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    c0 = tl.program_id(1) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    col = (tl.arange(0, W // V)[:, None] * V + tl.arange(0, V)[None, :])[None, :, :]
    slot = tl.arange(0, W // V)[None, :]
    acc = tl.zeros((BLOCK_N, W // V), dtype=tl.float32)
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        c = c0
        while c < c1:
            w, wh, h = _load_words(HI, q_ptr, hi_ptr, rows, nmask, c, stride_q, W, col)
            s0, s1, m0, m1, d, dmin = load_meta(
                False, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
            )
            acc = _chunk_dot(
                acc, c, c >= 0, w, wh, h, s0, s1, m0, m1, d, dmin, xf_ptr, xs_ptr, col, slot,
                magic, QTYPE, HI, W, G, V,
            )  # fmt: skip
            c += 1
    else:
        # chunk c + 1's words and scales are requested before chunk c is multiplied
        live = nmask & (c0 < c1)
        w, wh, h = _load_words(HI, q_ptr, hi_ptr, rows, live, c0, stride_q, W, col)
        s0, s1, m0, m1, d, dmin = load_meta(
            False, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, live, c0, stride_s, stride_d
        )
        for c in range(c0, c1):
            live = nmask & (c + 1 < c1)
            w2, wh2, h2 = _load_words(HI, q_ptr, hi_ptr, rows, live, c + 1, stride_q, W, col)
            t0, t1, n0, n1, e, emin = load_meta(
                False, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, live, c + 1, stride_s, stride_d
            )
            acc = _chunk_dot(
                acc, c, c < c1, w, wh, h, s0, s1, m0, m1, d, dmin, xf_ptr, xs_ptr, col, slot,
                magic, QTYPE, HI, W, G, V,
            )  # fmt: skip
            w, wh, h = w2, wh2, h2
            s0, s1, m0, m1, d, dmin = t0, t1, n0, n1, e, emin
    y = tl.sum(acc, axis=1)
    finish_rows(out_ptr, part_ptr, tickets_ptr, y, rows, N, BLOCK_N, SPLITS, ACT)
