"""The decode-batch GEMM in fp16: Q4_K weights built as fp16 tiles for one tensor-core dot a chunk.

``packed_gemm`` forms every weight in float32 exactly (the reference's value) and rounds it to
the activation dtype: about ten instructions a weight, so a 64-row decode batch takes 9 ms for
Llama-3-8B's 4.9 GB of Q4_K_M weights that HBM could deliver in 1.2 ms. Here a weight is formed
in fp16 with three operations on 16-bit values: the 4-bit code becomes ``1024 + q`` by OR-ing
it into the mantissa of 1024.0 (no conversion instruction), ``- 1024`` leaves ``q`` exactly,
and one fused multiply-add applies the sub-block's ``d * scale`` and ``dmin * min`` (rounded to
fp16 once per sub-block). Adjacent fp16 values share a register, so the compiler can issue the
16-bit operations two at a time. Activations are fp16 (the wrapper converts them, clamped to
fp16's range), products are summed in float32 on the tensor cores.

The weight has one fp16 rounding where the reference (float32 weight rounded to the bf16
activations' dtype) has one bf16 rounding: the result differs from ``x @ unpack(pw).T`` by
summation order and those roundings, within the reference's own bf16 error (tests).
Reference: ``x @ unpack(pw).T`` (tests/test_kernel_packed_gemm16.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from shared.kernels.qmatmul.packed import CHUNK, WORDS, PackedWeight
from shared.kernels.qmatmul.packed_chunk import load_chunk, load_meta

__all__ = ["F16_TYPES", "gemm16"]

F16_TYPES = frozenset({GGMLQuantizationType.Q4_K})
_FP16_MAX = 65504.0


@triton.jit
def _byte16(s, J: tl.constexpr):
    """Byte J (0..7) of the int64 words s -> float32."""
    return ((s >> (8 * J)) & 0xFF).to(tl.float32)


@triton.jit
def _scale16(d, dmin, s0, m0, J: tl.constexpr):
    """Sub-block J's (d * scale, dmin * min) as fp16 [BLOCK_N, 1] columns."""
    scale = (d * _byte16(s0, J)).to(tl.float16)[:, None]
    shift = (dmin * _byte16(m0, J)).to(tl.float16)[:, None]
    return scale, shift


@triton.jit
def _pair16(w, s0, m0, d, dmin, J: tl.constexpr):
    """Fields J and J + 4 of the words (bits 4J and 4J + 16: one mask and one OR for both)
    -> fp16 weights [BLOCK_N, W, 2]."""
    bits = ((w >> (4 * J)) & 0x000F000F) | 0x64006400  # 1024 + q in each half
    lo = (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    a0, b0 = _scale16(d, dmin, s0, m0, J)
    a1, b1 = _scale16(d, dmin, s0, m0, J + 4)
    return tl.join(lo * a0 - b0, hi * a1 - b1)


@triton.jit
def _tile16(w, s0, m0, d, dmin, W: tl.constexpr):
    """The chunk as one [BLOCK_N, 8 * W] fp16 tile in the order of ``_perm16``: column
    8 i + 2 j + h holds element 32 (j + 4 h) + i (word i, field j + 4 h)."""
    t = tl.join(tl.join(_pair16(w, s0, m0, d, dmin, 0), _pair16(w, s0, m0, d, dmin, 1)),
                tl.join(_pair16(w, s0, m0, d, dmin, 2), _pair16(w, s0, m0, d, dmin, 3)))
    # [BN, W, h, j0, j1] with j = j0 + 2 j1 -> [BN, W, j1, j0, h]
    t = tl.permute(t, (0, 1, 4, 3, 2))
    return tl.reshape(t, (w.shape[0], 8 * W))


@triton.jit
def _perm16(W: tl.constexpr):
    """Chunk element of each tile column (``_tile16``'s order)."""
    p = tl.arange(0, 8 * W)
    i = p // 8
    j = (p // 2) % 4
    h = p % 2
    return 32 * (j + 4 * h) + i


@triton.jit
def _step16(
    acc, c, x_rows, mmask, q_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask,
    stride_q, stride_s, stride_d, W: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    w, wh, h = load_chunk(False, q_ptr, q_ptr, rows, nmask, c, stride_q, W)
    s0, s1, m0, m1, d, dmin = load_meta(
        12, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
    )
    tile = _tile16(w, s0, m0, d, dmin, W)
    cols = c * (8 * W) + tl.arange(0, 8 * W)  # x pre-permuted (_perm16)
    xs = tl.load(x_rows + cols[None, :], mask=mmask[:, None], other=0.0)
    if INTERPRETED:  # its 16-bit dots multiply bit patterns: the same products in float32
        return tl.dot(xs.to(tl.float32), tl.trans(tile.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(xs, tl.trans(tile), acc)


@triton.jit
def _gemm16_kernel(
    x_ptr,  # [M, K] fp16 activations
    q_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [M, N]
    M, N, n_chunks, stride_xm, stride_om, stride_q, stride_s, stride_d,
    W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rows_m < M
    nmask = rows < N
    x_rows = x_ptr + rows_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        c = 0
        while c < n_chunks:
            acc = _step16(acc, c, x_rows, mmask, q_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows,
                          nmask, stride_q, stride_s, stride_d, W, INTERPRETED)
            c += 1
    else:
        for c in range(0, n_chunks):
            acc = _step16(acc, c, x_rows, mmask, q_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows,
                          nmask, stride_q, stride_s, stride_d, W, INTERPRETED)
    out = out_ptr + rows_m[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
