"""``x @ W.T`` for decode batches with W kept in a legacy 32-element GGUF block format.

Covers Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (``LEGACY_TYPES``). The weight is the tensor's raw bytes,
``raw: uint8 [N, K / 32 * type_size]``, exactly as in the file; the reference is
``x.float() @ shared.quant.dequantize(raw, qtype, (N, K)).T``.

Decode is bound by weight bandwidth, so each program owns BLOCK_N output rows and streams their
bytes exactly once, for all of its BLOCK_M activation rows, looping over K a few blocks at a time.
Inside a block the integer quants are multiplied by x and summed first; the block's fp16 scale d
(and, for the offset types, ``m * sum(x)``) is applied once per block, in float32:
``y = sum_blocks d * sum_j q_j x_j + m * sum_j x_j``.

Two constexpr paths:
  * FMA (M <= 4): a [BLOCK_N, BLOCKS, 16] tile of quants is dequantized to integers once and
    reused for each activation row with elementwise multiply + reduce.
  * dot (M > 4): per block, two ``tl.dot`` of x [BLOCK_M, 16] with the quants [16, BLOCK_N]
    (low and high nibbles); quants are small integers, exact in bf16/fp16, so the tensor cores
    see exactly the activation's values and accumulate in float32. float32 activations use
    ``input_precision="ieee"`` (slow but exact; serving runs bf16).

Split-K (a second grid axis) fills the GPU when N / BLOCK_N gives too few programs; the
partial sums go to a float32 workspace and are reduced by torch, so results are deterministic.

Bytes are read one uint8 at a time: 18/22/34-byte blocks give no alignment the compiler could
use for wider loads; adjacent lanes read adjacent bytes, so the DRAM traffic is still coalesced.
Tile sizes are fixed defaults; per-device autotuning comes later (tools/bench_qgemv.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from shared.kernels.device import interpreted, num_sms
from shared.quant import block_geometry
from shared.quant.legacy import LAYOUT

__all__ = ["LEGACY_TYPES", "quant_gemv_legacy"]

LEGACY_TYPES: tuple[T, ...] = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_FMA_M = 4  # above this the dot path's tensor cores beat per-row FMA
_FMA_BLOCK_N = 16
_FMA_BLOCKS = 8  # 32-element blocks per K iteration
_DOT_BLOCK_N = 64
_DOT_BLOCKS = 4
_MAX_BLOCK_M = 64


@triton.jit
def _fp16_at(p, mask):
    """p: pointers to a little-endian fp16 (two bytes, any alignment). Returns float32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_blocks(
    blk,  # [A, B] pointers to block starts
    mask,  # [A, B]
    M_OFF: tl.constexpr,
    QH_OFF: tl.constexpr,
    QS_OFF: tl.constexpr,
    BIAS: tl.constexpr,
    IS_Q8: tl.constexpr,
):
    """Returns q_lo, q_hi [A, B, 16] float32 integer quants of elements 0..15 and 16..31 (bias
    removed), d and m [A, B] float32 (m = 0 for the types without one)."""
    j = tl.arange(0, 16)[None, None, :]
    p = blk[:, :, None] + QS_OFF + j
    mk = mask[:, :, None]
    d = _fp16_at(blk, mask)
    if IS_Q8:
        q_lo = tl.load(p, mask=mk, other=0).to(tl.int8, bitcast=True).to(tl.int32)
        q_hi = tl.load(p + 16, mask=mk, other=0).to(tl.int8, bitcast=True).to(tl.int32)
    else:
        qs = tl.load(p, mask=mk, other=0).to(tl.int32)
        q_lo = qs & 0xF
        q_hi = qs >> 4
        if QH_OFF >= 0:
            # ggml reads qh as one little-endian uint32; bit i is element i's fifth bit.
            qh = tl.load(blk + QH_OFF, mask=mask, other=0).to(tl.int32)
            qh |= tl.load(blk + QH_OFF + 1, mask=mask, other=0).to(tl.int32) << 8
            qh |= tl.load(blk + QH_OFF + 2, mask=mask, other=0).to(tl.int32) << 16
            qh |= tl.load(blk + QH_OFF + 3, mask=mask, other=0).to(tl.int32) << 24
            qh = qh[:, :, None]
            q_lo |= ((qh >> j) & 1) << 4
            q_hi |= ((qh >> (j + 16)) & 1) << 4
        q_lo -= BIAS
        q_hi -= BIAS
    m = _fp16_at(blk + M_OFF, mask) if M_OFF >= 0 else tl.zeros_like(d)
    return q_lo.to(tl.float32), q_hi.to(tl.float32), d, m


@triton.jit
def _accumulate_chunk(
    acc,  # [BLOCK_M, BLOCK_N] float32
    k0,  # first 32-element block of this chunk
    kb_end,  # blocks at or past kb_end are masked off
    x_ptr,  # [M, K]
    x_rows,  # [BLOCK_M] pointers to this program's x rows
    w_rows,  # [BLOCK_N] pointers to this program's weight rows
    n_mask,  # [BLOCK_N]
    m_mask,  # [BLOCK_M]
    M,
    stride_xm,  # int64
    pid_m,
    TYPE_SIZE: tl.constexpr,
    M_OFF: tl.constexpr,
    QH_OFF: tl.constexpr,
    QS_OFF: tl.constexpr,
    BIAS: tl.constexpr,
    IS_Q8: tl.constexpr,
    USE_DOT: tl.constexpr,
    X_IS_F32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """acc + this program's products over blocks [k0, k0 + BLOCKS)."""
    j = tl.arange(0, 16)
    if USE_DOT:
        for b in tl.static_range(BLOCKS):
            kb = k0 + b
            valid = kb < kb_end
            blk = w_rows[:, None] + kb.to(tl.int64) * TYPE_SIZE  # [BLOCK_N, 1]
            q_lo, q_hi, d, m = _load_blocks(
                blk, n_mask[:, None] & valid, M_OFF, QH_OFF, QS_OFF, BIAS, IS_Q8
            )
            q_lo = tl.trans(tl.reshape(q_lo, (BLOCK_N, 16)))  # [16, BLOCK_N]
            q_hi = tl.trans(tl.reshape(q_hi, (BLOCK_N, 16)))
            xp = x_rows[:, None] + kb * 32 + j[None, :]  # [BLOCK_M, 16]
            x_mask = m_mask[:, None] & valid
            x_lo = tl.load(xp, mask=x_mask, other=0.0)
            x_hi = tl.load(xp + 16, mask=x_mask, other=0.0)
            if X_IS_F32 or INTERPRETED:
                # the interpreter would multiply bf16 bit patterns as uint16
                x_lo = x_lo.to(tl.float32)
                x_hi = x_hi.to(tl.float32)
                s = tl.dot(x_lo, q_lo, input_precision="ieee")
                s = tl.dot(x_hi, q_hi, s, input_precision="ieee")
            else:
                s = tl.dot(x_lo, q_lo.to(x_lo.dtype))
                s = tl.dot(x_hi, q_hi.to(x_hi.dtype), s)
            acc += s * tl.reshape(d, (1, BLOCK_N))
            if M_OFF >= 0:
                x_sum = tl.sum(x_lo.to(tl.float32) + x_hi.to(tl.float32), axis=1)
                acc += x_sum[:, None] * tl.reshape(m, (1, BLOCK_N))
    else:
        kb = k0 + tl.arange(0, BLOCKS)  # [BLOCKS]
        kb_mask = kb < kb_end
        blk = w_rows[:, None] + kb[None, :].to(tl.int64) * TYPE_SIZE  # [BLOCK_N, BLOCKS]
        q_lo, q_hi, d, m = _load_blocks(
            blk, n_mask[:, None] & kb_mask[None, :], M_OFF, QH_OFF, QS_OFF, BIAS, IS_Q8
        )
        for r in tl.static_range(BLOCK_M):
            row = pid_m * BLOCK_M + r
            xp = x_ptr + row.to(tl.int64) * stride_xm + kb[:, None] * 32 + j[None, :]
            x_mask = kb_mask[:, None] & (row < M)
            x_lo = tl.load(xp, mask=x_mask, other=0.0).to(tl.float32)  # [BLOCKS, 16]
            x_hi = tl.load(xp + 16, mask=x_mask, other=0.0).to(tl.float32)
            s = tl.sum(q_lo * x_lo[None, :, :] + q_hi * x_hi[None, :, :], axis=2)
            part = s * d  # [BLOCK_N, BLOCKS]
            if M_OFF >= 0:
                part += m * tl.sum(x_lo + x_hi, axis=1)[None, :]
            y = tl.sum(part, axis=1)  # [BLOCK_N]
            acc = tl.where(tl.arange(0, BLOCK_M)[:, None] == r, acc + y[None, :], acc)
    return acc


@triton.jit
def _qgemv_legacy_kernel(
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N, row_bytes] uint8 GGUF blocks, last dim contiguous
    out_ptr,  # [SPLIT_K, M, N] contiguous (SPLIT_K = 1: the output dtype, else float32 partials)
    M,
    N,
    n_kblocks,  # K / 32
    blocks_per_split,  # a multiple of BLOCKS
    stride_xm,  # int64
    stride_wn,  # int64
    stride_os,  # int64, M * N (0 when SPLIT_K = 1)
    TYPE_SIZE: tl.constexpr,
    M_OFF: tl.constexpr,
    QH_OFF: tl.constexpr,
    QS_OFF: tl.constexpr,
    BIAS: tl.constexpr,
    IS_Q8: tl.constexpr,
    USE_DOT: tl.constexpr,
    X_IS_F32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,  # 32-element blocks per K iteration
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rows_n < N
    m_mask = rows_m < M
    w_rows = w_ptr + rows_n.to(tl.int64) * stride_wn  # [BLOCK_N]
    x_rows = x_ptr + rows_m.to(tl.int64) * stride_xm  # [BLOCK_M]
    kb_start = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, n_kblocks)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if INTERPRETED:
        # The interpreter cannot range() over tensor bounds with numpy >= 2.4 (triton#9171).
        k0 = kb_start
        while k0 < kb_end:
            acc = _accumulate_chunk(
                acc, k0, kb_end, x_ptr, x_rows, w_rows, n_mask, m_mask, M, stride_xm,
                pid_m, TYPE_SIZE, M_OFF, QH_OFF, QS_OFF, BIAS, IS_Q8, USE_DOT, X_IS_F32,
                INTERPRETED, BLOCK_M, BLOCK_N, BLOCKS,
            )  # fmt: skip
            k0 += BLOCKS
    else:
        for k0 in range(kb_start, kb_end, BLOCKS):
            acc = _accumulate_chunk(
                acc, k0, kb_end, x_ptr, x_rows, w_rows, n_mask, m_mask, M, stride_xm,
                pid_m, TYPE_SIZE, M_OFF, QH_OFF, QS_OFF, BIAS, IS_Q8, USE_DOT, X_IS_F32,
                INTERPRETED, BLOCK_M, BLOCK_N, BLOCKS,
            )  # fmt: skip

    out = out_ptr + pid_k.to(tl.int64) * stride_os
    out += rows_m.to(tl.int64)[:, None] * N + rows_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _auto_split_k(n_programs: int, n_kblocks: int, blocks: int, device: torch.device) -> int:
    # Aim for two waves of programs; keep at least 4 iterations of K per split.
    want = -(-2 * num_sms(device) // n_programs)
    return max(1, min(want, n_kblocks // (4 * blocks)))


def quant_gemv_legacy(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: int,
    out_dtype: torch.dtype | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ dequantize(raw, qtype, (N, K)).T`` with float32 accumulation.

    x: [M, K] float32/float16/bfloat16, last dim contiguous; raw: uint8 [N, K / 32 * type_size]
    GGUF blocks, last dim contiguous; qtype one of ``LEGACY_TYPES``. Returns [M, N] in
    ``out_dtype`` (default x.dtype). Tuned for M = 1..64 (larger M works, as a grid of M tiles).
    ``split_k`` overrides the automatic split of K across programs.
    """
    try:
        qt = T(int(qtype))
    except ValueError:
        raise ValueError(f"quant_gemv_legacy: unknown GGML type id {int(qtype)}") from None
    if qt not in LAYOUT:
        names = ", ".join(t.name for t in LEGACY_TYPES)
        raise ValueError(f"quant_gemv_legacy: {qt.name} is not one of {names}")
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"quant_gemv_legacy: x must be a 2-D float tensor, got {tuple(x.shape)} {x.dtype}"
        )
    if raw.dim() != 2 or raw.dtype != torch.uint8:
        raise ValueError(
            f"quant_gemv_legacy: raw must be 2-D uint8, got {tuple(raw.shape)} {raw.dtype}"
        )
    if raw.device != x.device:
        raise ValueError(f"quant_gemv_legacy: raw on {raw.device}, x on {x.device}")
    m_rows, k = x.shape
    n = raw.shape[0]
    block_size, type_size = block_geometry(qt)
    if k % block_size or raw.shape[1] != k // block_size * type_size:
        raise ValueError(
            f"quant_gemv_legacy: {qt.name} with K={k} needs rows of "
            f"{k // block_size * type_size} bytes (K a multiple of {block_size}), "
            f"got raw {tuple(raw.shape)}"
        )
    if x.stride(-1) != 1 or raw.stride(-1) != 1:
        raise ValueError(
            f"quant_gemv_legacy: last dims must be contiguous, x strides {x.stride()}, "
            f"raw strides {raw.stride()}"
        )
    out_dtype = out_dtype or x.dtype
    if m_rows == 0 or n == 0 or k == 0:
        return torch.zeros(m_rows, n, dtype=out_dtype, device=x.device)

    use_dot = m_rows > _MAX_FMA_M
    if use_dot:
        block_m = min(max(16, triton.next_power_of_2(m_rows)), _MAX_BLOCK_M)
        block_n, blocks = _DOT_BLOCK_N, _DOT_BLOCKS
    else:
        block_m = triton.next_power_of_2(m_rows)
        block_n, blocks = _FMA_BLOCK_N, _FMA_BLOCKS
    n_kblocks = k // block_size
    grid_n, grid_m = triton.cdiv(n, block_n), triton.cdiv(m_rows, block_m)
    if split_k is None:
        split_k = _auto_split_k(grid_n * grid_m, n_kblocks, blocks, x.device)
    split_k = max(1, min(int(split_k), triton.cdiv(n_kblocks, blocks)))
    per_split = triton.cdiv(triton.cdiv(n_kblocks, split_k), blocks) * blocks
    split_k = triton.cdiv(n_kblocks, per_split)

    if split_k == 1:
        out = torch.empty(1, m_rows, n, dtype=out_dtype, device=x.device)
    else:
        out = torch.empty(split_k, m_rows, n, dtype=torch.float32, device=x.device)
    m_off, qh_off, qs_off, bias = LAYOUT[qt]
    _qgemv_legacy_kernel[(grid_n, split_k, grid_m)](
        x,
        raw,
        out,
        m_rows,
        n,
        n_kblocks,
        per_split,
        x.stride(0),
        raw.stride(0),
        m_rows * n if split_k > 1 else 0,
        TYPE_SIZE=type_size,
        M_OFF=m_off,
        QH_OFF=qh_off,
        QS_OFF=qs_off,
        BIAS=bias,
        IS_Q8=qt == T.Q8_0,
        USE_DOT=use_dot,
        X_IS_F32=x.dtype == torch.float32,
        INTERPRETED=interpreted(_qgemv_legacy_kernel),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCKS=blocks,
        num_warps=4,
    )
    if split_k == 1:
        return out[0]
    return out.sum(0).to(out_dtype)
