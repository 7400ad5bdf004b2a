"""The pass after a split-K paged attention (``paged_attention_jit``): each head's slices,
weighted by their maxima, summed into the output row, and with ROUND rounded to int8 for the
next GEMV. ``shared.kernels.paged_attention`` launches it."""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.gdc import launch_next, wait_prev
from shared.kernels.qmatmul.int8_activations import round_blocks
from shared.kernels.rounding import to_dtype


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, n_heads, head_dim]
    part_acc_ptr,  # [num_splits, T, n_heads, head_dim] float32
    part_m_ptr,  # [num_splits, T, n_heads] float32
    part_l_ptr,  # [num_splits, T, n_heads] float32
    num_splits,
    splits_ptr,  # [1] int32: the slices used (DYNAMIC_SPLITS only); 1 = out is written already
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_pa_s: tl.int64,
    stride_pa_t: tl.int64,
    stride_pa_h: tl.int64,
    stride_pm_s: tl.int64,
    stride_pm_t: tl.int64,
    stride_pm_h: tl.int64,
    xq_ptr,
    xd_ptr,
    xs_ptr,  # the (single) token's output rounded to int8 in layout (W, G) (ROUND)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    DYNAMIC_SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,  # launched early (shared.kernels.gdc)
    ROUND: tl.constexpr = False,  # one token, BLOCK_D = HEAD_DIM, a multiple of W
    W: tl.constexpr = 32,
    G: tl.constexpr = 8,
):
    launch_next(PDL)
    n_splits = num_splits
    if DYNAMIC_SPLITS:
        n_splits = tl.load(splits_ptr)  # before the wait, as the attention kernel's
    wait_prev(PDL)  # before the early return, as the attention kernel's
    if n_splits == 1:
        return
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    s_ok = s < n_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pm_off = s * stride_pm_s + token * stride_pm_t + head * stride_pm_h
    m = tl.load(part_m_ptr + pm_off, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + pm_off, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty slices weigh 0
    pa_off = s[:, None] * stride_pa_s + token * stride_pa_t + head * stride_pa_h + d[None, :]
    acc = tl.load(part_acc_ptr + pa_off, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    o = to_dtype(o, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + d, o, mask=d_ok)
    if ROUND:  # the head's sub-blocks of the output row, from the stored values
        b0 = head * (HEAD_DIM // W)
        y = tl.reshape(o.to(tl.float32), (BLOCK_D // W, W))
        round_blocks(y, b0, b0 + HEAD_DIM // W, xq_ptr, xd_ptr, xs_ptr, W, G)
