"""The decode-batch GEMM on int8 tensor cores (``I8: 1``): packed codes times int8 activations.

A 64-row decode batch of an 8B model multiplies by the bf16 dense copies through cuBLAS (16 GB
read a step, about 4.5 ms of W2's 8 ms step on the H200, BENCHMARKS.md 2026-11-30 (n)), or by
the float-formed packed tiles (``packed_gemm``, ``packed_gemm16``), which spend 6-14
instructions forming every weight. As llama.cpp's MMQ does, this kernel keeps the codes as
integers: a field of a chunk's words (``packed_chunk``) is masked into int8 codes, the
activations are rounded to int8 per sub-block (``int8_activations.prepare_rows_int8``: the
GEMV's rounding, in row order), and one ``tl.dot`` per sub-block sums ``code * x`` exactly in
int32. As in ``packed_gemm_first``, the codes are the dot's first operand (``codes @ x.T``,
[BLOCK_N, BLOCK_M]): on Hopper a wgmma of 64 weight rows reads them from registers (sm_90,
``tools/kernel_sass``: ``IGMMA.64x16x32.S8.S8`` with no STS or LDSM in the Q4_K loop) with the
activation tile as N, where the activations-first form (x @ codes.T) took 16-row mma.sync tiles
and staged the codes through shared memory, and lost to the fp16 GEMMs 2-4x (BENCHMARKS.md
(u)). The sub-block's scales then meet that sum once per output:

    out[m, n] += dx[m, j] * A[n, j] * dot - xs[m, j] * B[n, j]

with the weight ``A * code - B`` (Q4_K: ``d * sc`` and ``dmin * mn``; Q6_K: ``d * sc`` and
``32 d * sc``; Q8_0: ``d`` and 0, signed codes; the legacy types as ``packed_int8``), ``dx``
the activations' step and ``xs`` their float sum. The weights are read once (4.9 GB for
Q4_K_M, not 16) and either plane layout is read (``R32``).

The result is ``x_hat @ unpack(pw).T`` where x_hat is x rounded per sub-block: within the
rounding's bound, as the int8 GEMVs (tests/test_kernel_packed_gemm8.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from shared.kernels.qmatmul.int8_activations import prepare_rows_int8
from shared.kernels.qmatmul.layout import INT8_TYPES
from shared.kernels.qmatmul.packed_chunk import (
    Q6_K,
    Q8_0,
    _byte,
    _half,
    _nibble_scale,
    _signed,
    load_chunk,
    load_meta,
)
from shared.kernels.qmatmul.packed_gemm import (
    fields,
    gemm_tile,
    launch_split,
    planes,
    store_tile,
    strides,
)

__all__ = ["CHUNK_STEP_TYPES", "I8_TYPES", "launch_gemm8"]

I8_TYPES = INT8_TYPES  # the types with int8 codes (packed_int8's)
_T = GGMLQuantizationType
# integer sub-block scales: activations take one step a chunk (ggml's Q8_K) and the dots meet
# the scales in int32
CHUNK_STEP_TYPES = frozenset({_T.Q4_K, _T.Q5_K, _T.Q6_K})


@triton.jit
def _codes(QTYPE: tl.constexpr, HI: tl.constexpr, J: tl.constexpr, w, wh, h):
    """Field J of the chunk's words as int8 codes [BLOCK_N, W] (unsigned, high bits included;
    Q8_0's signed bytes)."""
    if QTYPE == Q8_0:
        src = w
        if J >= 2:
            src = wh
        b = (src >> (8 * (J % 2))) & 0xFF
        return ((b ^ 0x80) - 0x80).to(tl.int8)
    src = w
    if J >= 4:
        src = wh
    q = (src >> (4 * (J % 4))) & 0xF
    if QTYPE == Q6_K:
        q = q | (((h >> (2 * J)) & 0x3) << 4)
    elif HI:
        q = q | (((h >> J) & 0x1) << 4)
    return q.to(tl.int8)


@triton.jit
def _scale(QTYPE: tl.constexpr, J: tl.constexpr, s0, s1, m0, m1, d, dmin):
    """Sub-block J's (A, B) per row, weight = A * code - B."""
    if QTYPE == Q8_0:
        a = _half(s0, s0, J)
        return a, a * 0.0
    if QTYPE == Q6_K:
        a = d * _signed(_byte(s0, s0, J)).to(tl.float32)
        return a, 32.0 * a
    return _nibble_scale(QTYPE, J, s0, s1, m0, m1, d, dmin)


@triton.jit
def _dot(QTYPE: tl.constexpr, HI: tl.constexpr, J: tl.constexpr, xq_cols, c, mmask, w, wh, h,
         W: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """int32 [BLOCK_N, BLOCK_M]: sub-block J's codes (the dot's first operand, formed in
    registers) times its int8 activations (xq_cols: the rows' pointers as columns). An int8
    dot takes K >= 32: sub-blocks of 16 (Q6_K) join their neighbour's codes and see zeros for
    its activations."""
    if W == 32:
        i = tl.arange(0, W)[:, None]
        xj = tl.load(xq_cols + c * (W * G) + J * W + i, mask=mmask[None, :], other=0)
        return tl.dot(_codes(QTYPE, HI, J, w, wh, h), xj, out_dtype=tl.int32)
    P: tl.constexpr = J - J % 2  # the pair's first sub-block
    t = tl.arange(0, 2 * W)[:, None]
    own = (t >= W) == (J % 2 == 1)  # J's half of the pair's activations; zeros for the other
    x2 = tl.load(xq_cols + c * (W * G) + P * W + t, mask=own & mmask[None, :], other=0)
    pair = tl.join(_codes(QTYPE, HI, P, w, wh, h), _codes(QTYPE, HI, P + 1, w, wh, h))
    pair = tl.reshape(tl.permute(pair, (0, 2, 1)), (w.shape[0], 2 * W))
    return tl.dot(pair, x2, out_dtype=tl.int32)


@triton.jit
def _step8(
    acc, c, xq_cols, xd_cols, xs_cols, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    rows, nmask, stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr, R32: tl.constexpr,
    CHUNK_STEP: tl.constexpr,
):  # fmt: skip
    """Chunk c into acc ([BLOCK_N, BLOCK_M]: weight rows by activation rows). K-quants (one
    activation step a chunk): the sub-blocks' dots meet their integer scales in int32, the float
    factors once a chunk. Other types: each dot is scaled by its sub-block's steps and fp16
    factors."""
    w, wh, h = load_chunk(R32, HI, q_ptr, hi_ptr, rows, nmask, c, stride_q, W)
    s0, s1, m0, m1, d, dmin = load_meta(
        R32, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
    )
    if CHUNK_STEP:
        isum = tl.zeros(acc.shape, dtype=tl.int32)  # sum_j sc_j * dot_j
        imin = tl.zeros(acc.shape, dtype=tl.int32)  # sum_j mn_j (Q6_K: sc_j) * sum(codes_j)
        for j in tl.static_range(G):
            sc = _byte(s0, s0, j)
            if QTYPE == Q6_K:
                sc = _signed(sc)
                mn = sc
            else:
                mn = _byte(m0, m0, j)
            isum += _dot(QTYPE, HI, j, xq_cols, c, mmask, w, wh, h, W, G) * sc[:, None]
            qs = tl.load(xs_cols + c * G + j, mask=mmask, other=0)
            imin += mn[:, None] * qs[None, :]
        dx = tl.load(xd_cols + c, mask=mmask, other=0.0)
        if QTYPE == Q6_K:  # d * sc * (q - 32)
            acc += ((isum - 32 * imin).to(tl.float32) * d[:, None]) * dx[None, :]
        else:  # d * sc * q - dmin * mn
            part = isum.to(tl.float32) * d[:, None] - imin.to(tl.float32) * dmin[:, None]
            acc += part * dx[None, :]
    else:
        for j in tl.static_range(G):
            dot = _dot(QTYPE, HI, j, xq_cols, c, mmask, w, wh, h, W, G)
            a, b = _scale(QTYPE, j, s0, s1, m0, m1, d, dmin)
            dx = tl.load(xd_cols + c * G + j, mask=mmask, other=0.0)
            acc += (dot.to(tl.float32) * a[:, None]) * dx[None, :]
            if QTYPE != Q8_0:
                acc -= b[:, None] * tl.load(xs_cols + c * G + j, mask=mmask, other=0.0)[None, :]
    return acc


@triton.jit
def _gemm8_kernel(
    xq_ptr,  # [M, K] int8: x rounded per sub-block (prepare_rows_int8)
    xd_ptr, xs_ptr,  # steps and sums (prepare_rows_int8: a chunk's for the K-quants)
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [M, N] (or [M, N / 2] with ACT), or [SPLITS, M, N] float32 partials (split-K)
    M, N, n_chunks, per_split, stride_xm, stride_dm, stride_sm, stride_om, stride_os,
    stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs; store act(gate) * up
    R32: tl.constexpr,  # row-interleaved planes (packed_rows)
    CHUNK_STEP: tl.constexpr,  # one activation step a chunk (CHUNK_STEP_TYPES)
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows_m, rows, mmask, nmask, c0, c1 = gemm_tile(M, N, n_chunks, per_split, BLOCK_M, BLOCK_N)
    xq_cols = xq_ptr + rows_m[None, :] * stride_xm  # the activation rows as the dot's columns
    xd_cols = xd_ptr + rows_m * stride_dm
    xs_cols = xs_ptr + rows_m * stride_sm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # weight rows x activation rows
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        c = c0
        while c < c1:
            acc = _step8(
                acc, c, xq_cols, xd_cols, xs_cols, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr,
                dmin_ptr, rows, nmask, stride_q, stride_s, stride_d, QTYPE, HI, W, G, R32,
                CHUNK_STEP,
            )  # fmt: skip
            c += 1
    else:
        for c in range(c0, c1):
            acc = _step8(
                acc, c, xq_cols, xd_cols, xs_cols, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr,
                dmin_ptr, rows, nmask, stride_q, stride_s, stride_d, QTYPE, HI, W, G, R32,
                CHUNK_STEP,
            )  # fmt: skip
    store_tile(out_ptr, tl.trans(acc), rows_m, rows, M, N, stride_om, stride_os, BLOCK_M, BLOCK_N,
               ACT)  # fmt: skip


def launch_gemm8(x, pw, out, cfg, interp, act: int = 0) -> None:
    """out = x @ unpack(pw).T within the int8 rounding of x ([M, N]), or with act the gated
    activation of its interleaved gate/up columns ([M, N / 2]). cfg: BLOCK_M, BLOCK_N,
    num_warps, num_stages, SPLIT_K (absent: split when the tiles leave SMs idle)."""
    if pw.qtype not in I8_TYPES:
        raise ValueError(f"gemm8: {pw.qtype.name} has no int8 codes")
    chunk_step = pw.qtype in CHUNK_STEP_TYPES
    xq, xd, xs = prepare_rows_int8(x, pw, chunk_step=chunk_step)

    def launch(grid, target, n_chunks, per_split, epilogue):
        _gemm8_kernel[grid](
            xq, xd, xs, *planes(pw), target, out.shape[0], pw.shape[0], n_chunks, per_split,
            xq.stride(0), xd.stride(0), xs.stride(0), target.stride(-2), out.shape[0] * pw.shape[0],
            *strides(pw), **fields(pw), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            ACT=epilogue, R32=pw.rows32, CHUNK_STEP=chunk_step, INTERPRETED=interp,
            num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2),
        )  # fmt: skip

    launch_split(pw, out, cfg, act, launch)
