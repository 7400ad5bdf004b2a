"""The decode-batch GEMM with the weights as the tensor-core dot's first operand, one sub-block
(field) at a time, kept in registers.

``packed_gemm`` and ``packed_gemm16`` form a weight tile and hand it to the dot as its second
operand: on Hopper that operand is read from shared memory, so every tile is stored there, a
barrier passes, and only then the wgmma runs. Here the field is formed exactly as the GEMV forms
it (``packed_chunk.group``: the reference's float32 value), rounded to the activation dtype
and multiplied as ``w @ x.T`` (accumulator ``[BLOCK_N, BLOCK_M]``): a wgmma's first operand may
come from registers, and since every step from the loaded words to the rounded field is
elementwise in the ``[BLOCK_N, W]`` shape, Triton loads the words straight into that operand's
layout. The formed weights never touch shared memory (sm_90: no STS or LDSM in the loop,
``tools/kernel_sass``); only the activation tiles pass through it, staged by cp.async. One
field is K = W (32 or 16) a dot.

On the H200 (BENCHMARKS.md 2026-12-01 (aa)) this took 0.58-0.90x the time of the other packed
GEMMs for Q4_K and Q8_0 at 16 and 64 rows (28672 x 4096 Q4_K at 64 rows: 84 us against 124),
level with cuBLAS on a bf16 copy at 16 rows on the largest shapes and still behind it at 64
(66 us there). Q6_K's other kernels stay faster. Each dot's wgmmas are waited for before the
next operand is formed, so a program overlaps nothing itself: the SM's other programs do
(split-K keeps a few an SM). Joining FJ adjacent fields along K makes fewer, longer dots.
Reference: ``x @ unpack(pw).T`` (tests/test_kernel_packed_gemm_first.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.qmatmul.layout import PackedWeight
from shared.kernels.qmatmul.packed_chunk import group, load_chunk, load_meta
from shared.kernels.qmatmul.packed_gemm import (
    fields,
    gemm_tile,
    launch_split,
    planes,
    store_tile,
    strides,
)
from shared.kernels.rounding import to_dtype

__all__ = ["launch_gemm_first"]


@triton.jit
def _dot_first(acc, val, xj, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # its 16-bit dots multiply bit patterns: the rounded values in float32
        wr = to_dtype(val, xj.dtype, INTERPRETED).to(tl.float32)
        return tl.dot(wr, xj.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(val.to(xj.dtype), xj, acc)


@triton.jit
def _chunk_first(
    acc, c, x_cols, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask,
    stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
    R32: tl.constexpr, INTERPRETED: tl.constexpr, FJ: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] plus chunk c's products, one dot a field or, with FJ 2 or 4, one
    dot of FJ adjacent fields joined along K (their words are the same, so each thread already
    holds the joined operand's values: no data moves, offline; fewer waits, more registers)."""
    w, wh, h = load_chunk(R32, HI, q_ptr, hi_ptr, rows, nmask, c, stride_q, W)
    s0, s1, m0, m1, d, dmin = load_meta(
        R32, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
    )
    for j in tl.static_range(0, G, FJ):
        # the magic (packed_chunk.MAGIC) as an immediate, as packed_gemm passes it
        t = group(QTYPE, HI, j, w, wh, h, s0, s1, m0, m1, d, dmin, 0x4B000000)
        if FJ >= 2:
            b = group(QTYPE, HI, j + 1, w, wh, h, s0, s1, m0, m1, d, dmin, 0x4B000000)
            if FJ == 2:
                t = tl.reshape(tl.permute(tl.join(t, b), (0, 2, 1)), (w.shape[0], 2 * W))
            else:
                e = group(QTYPE, HI, j + 2, w, wh, h, s0, s1, m0, m1, d, dmin, 0x4B000000)
                f = group(QTYPE, HI, j + 3, w, wh, h, s0, s1, m0, m1, d, dmin, 0x4B000000)
                t = tl.join(tl.join(t, b), tl.join(e, f))
                t = tl.reshape(tl.permute(t, (0, 3, 2, 1)), (w.shape[0], 4 * W))
        cols = c * (W * G) + j * W + tl.arange(0, FJ * W)
        xj = tl.load(x_cols + cols[:, None], mask=mmask[None, :], other=0.0)  # [FJ * W, BM]
        acc = _dot_first(acc, t, xj, INTERPRETED)
    return acc


@triton.jit
def _gemm_first_kernel(
    x_ptr,  # [M, K] 16-bit activations
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [M, N] (or [M, N / 2] with ACT), or [SPLITS, M, N] float32 partials (split-K)
    M, N, n_chunks, per_split, stride_xm, stride_om, stride_os, stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R32: tl.constexpr,  # row-interleaved planes (packed_rows)
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs; store act(gate) * up
    INTERPRETED: tl.constexpr,
    FJ: tl.constexpr = 1,  # fields a dot (1, 2 or 4; at most G)
):  # fmt: skip
    rows_m, rows, mmask, nmask, c0, c1 = gemm_tile(M, N, n_chunks, per_split, BLOCK_M, BLOCK_N)
    x_cols = x_ptr + rows_m[None, :] * stride_xm  # the rows' starts, [1, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        c = c0
        while c < c1:
            acc = _chunk_first(
                acc, c, x_cols, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows,
                nmask, stride_q, stride_s, stride_d, QTYPE, HI, W, G, R32, INTERPRETED, FJ,
            )  # fmt: skip
            c += 1
    else:  # a for loop: Triton pipelines its loads (cp.async stages), not a while loop's
        for c in range(c0, c1):
            acc = _chunk_first(
                acc, c, x_cols, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows,
                nmask, stride_q, stride_s, stride_d, QTYPE, HI, W, G, R32, INTERPRETED, FJ,
            )  # fmt: skip
    store_tile(
        out_ptr, tl.trans(acc), rows_m, rows, M, N, stride_om, stride_os, BLOCK_M, BLOCK_N, ACT
    )


def launch_gemm_first(x, pw: PackedWeight, out, cfg, interp, act: int = 0) -> None:
    """out = x @ unpack(pw).T ([M, N]), or with act the gated activation of its interleaved
    gate/up columns ([M, N / 2]); x in fp16 or bf16. cfg: BLOCK_M, BLOCK_N (64 or more: a
    wgmma's rows), num_warps, num_stages, SPLIT_K (absent: split when the tiles leave SMs
    idle), FJ (fields a dot, default 1)."""

    def launch(grid, target, n_chunks, per_split, epilogue):
        _gemm_first_kernel[grid](
            x, *planes(pw), target, out.shape[0], pw.shape[0], n_chunks, per_split,
            x.stride(0), target.stride(-2), out.shape[0] * pw.shape[0], *strides(pw),
            **fields(pw), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], R32=pw.rows32,
            ACT=epilogue, INTERPRETED=interp, FJ=cfg.get("FJ", 1),
            num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2),
        )  # fmt: skip

    launch_split(pw, out, cfg, act, launch)
