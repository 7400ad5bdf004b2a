"""RMSNorm in Triton: plain rows, per-head (QK-norm) and fused with the residual add.

One program normalizes one row in registers, in float32 whatever the activation dtype, so a row
is read once and written once; a few rows (decode) spread each over programs of ``_SLICE``
columns, which all sum the whole row's squares (read again from cache) and store their own
columns. References: shared/ops/norm.py (`rms_norm`) and
shared/ops/fused_norm.py (`add_rms_norm_ref`).

``add_rms_norm_int8`` (with or without the residual add): for a few rows (decode at batch 1,
and up to ``ROUND_ROWS`` for the batch rows GEMV) the same launch also rounds the normed rows
to int8 for the GEMVs that read them (``int8_activations``: one layout a weight type, at most
two), from the values it stores, so the codes are those a separate rounding launch would make
of ``out``; that launch is saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.gdc import launch_kw, launch_next, pdl, wait_prev
from shared.kernels.qmatmul.int8_activations import int8_buffers_for, round_blocks

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A row lives in registers; past this a looped two-pass kernel would be needed.
_MAX_ROW = 65536
# Up to this many rows, a row's columns are spread over programs of _SLICE each (_slice).
_SLICED_ROWS = 8
# the most rows add_rms_norm_int8 rounds (packed_int8_rows_batch.BATCH_ROWS: the batch rows GEMV
# takes up to 4)
ROUND_ROWS = 4
_SLICE = 512


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H, N] (H = 1 for plain rows), last dim contiguous
    res_ptr,  # [T, N] residual, read only when HAS_RESIDUAL
    w_ptr,  # [N]
    out_ptr,  # [T, H, N] contiguous
    res_out_ptr,  # [T, N] contiguous: x + residual, written only when HAS_RESIDUAL
    xq1_ptr,
    xd1_ptr,
    xs1_ptr,  # the row rounded to int8 for layout (W1, G1) (ROUND >= 1)
    xq2_ptr,
    xd2_ptr,
    xs2_ptr,  # ... and for (W2, G2) (ROUND == 2)
    stride_xt,  # int64
    stride_xh,  # int64
    stride_rt,  # int64
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLICE: tl.constexpr,  # columns a program stores (program_id(2)); BLOCK_N: the whole row
    PDL: tl.constexpr,  # launched early (shared.kernels.gdc)
    ROUND: tl.constexpr = 0,  # layouts the (single) row is rounded for: 0, 1 or 2
    W1: tl.constexpr = 32,
    G1: tl.constexpr = 8,
    W2: tl.constexpr = 32,
    G2: tl.constexpr = 8,
    stride_r1=0,  # with ROUND_ROWS_AT: the rounded rows' strides ([T, K / 4] words,
    stride_s1=0,  # [T, K / W] scales and sums), layout 1
    stride_r2=0,
    stride_s2=0,  # ... and layout 2
    ROUND_ROWS_AT: tl.constexpr = False,  # several rows rounded: row t at t * its strides
):
    # Every load in one memory round trip: the weight's slice before wait_prev (a constant),
    # the program's slice of the row with the whole row, not after its sum of squares (H200,
    # W1: +0.9 to +1.5 % against three dependent round trips, BENCHMARKS.md 2026-12-02 (an)).
    launch_next(PDL)
    own = tl.program_id(2) * SLICE + tl.arange(0, SLICE)  # the columns this program stores
    w = tl.load(w_ptr + own, mask=own < n_cols, other=0.0).to(tl.float32)  # no kernel writes it
    wait_prev(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n_heads = tl.num_programs(1)
    x_row = x_ptr + t * stride_xt + h * stride_xh
    res_row = res_ptr + t * stride_rt
    if SLICE < BLOCK_N:  # this program's slice of the row, with the whole row
        x_own = _row_sum(x_row, res_row, own, own < n_cols, HAS_RESIDUAL)
    cols = tl.arange(0, BLOCK_N)
    x = _row_sum(x_row, res_row, cols, cols < n_cols, HAS_RESIDUAL)
    mean_sq = tl.sum(x * x, axis=0) / n_cols  # the whole row's, in every program of a row
    if SLICE < BLOCK_N:
        cols = own
        x = x_own
    mask = cols < n_cols
    if HAS_RESIDUAL:  # the sum as stored (rounded to the activation dtype), normalized below
        tl.store(res_out_ptr + t * n_cols + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    y = (x * tl.rsqrt(mean_sq + eps) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (t * n_heads + h) * n_cols + cols, y, mask=mask)
    c0 = tl.program_id(2) * SLICE  # the slice's sub-blocks, from the stored values
    if ROUND_ROWS_AT:  # this row's buffers
        xq1_ptr += t * stride_r1
        xd1_ptr += t * stride_s1
        xs1_ptr += t * stride_s1
        xq2_ptr += t * stride_r2
        xd2_ptr += t * stride_s2
        xs2_ptr += t * stride_s2
    if ROUND >= 1:
        y1 = tl.reshape(y.to(tl.float32), (SLICE // W1, W1))
        round_blocks(y1, c0 // W1, n_cols // W1, xq1_ptr, xd1_ptr, xs1_ptr, W1, G1)
    if ROUND == 2:
        y2 = tl.reshape(y.to(tl.float32), (SLICE // W2, W2))
        round_blocks(y2, c0 // W2, n_cols // W2, xq2_ptr, xd2_ptr, xs2_ptr, W2, G2)


@triton.jit
def _row_sum(x_row, res_row, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ the residual, the sum rounded to the residual's dtype) at cols, as float32, zero
    where masked. The loads are issued where they stand in the program (volatile), not sunk
    towards their first use."""
    x = tl.load(x_row + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_row + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
        x = (x + r).to(res_row.dtype.element_ty).to(tl.float32)
    return x


def _check_weight(x: torch.Tensor, weight: torch.Tensor, n: int) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"rms_norm: x dtype {x.dtype} is not one of float32, float16, bfloat16")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"rms_norm: weight dtype {weight.dtype} is not a float dtype")
    if weight.dim() != 1 or weight.shape[0] != n or not weight.is_contiguous():
        raise ValueError(
            f"rms_norm: weight must be a contiguous [{n}] vector, got {tuple(weight.shape)} "
            f"with strides {weight.stride()}"
        )
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight on {weight.device}, x on {x.device}")
    if x.shape[-1] > _MAX_ROW:
        raise ValueError(f"rms_norm: rows of {x.shape[-1]} exceed the {_MAX_ROW} supported")
    if x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x's last dim must be contiguous, strides {x.stride()}")


def _launch_config(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    return block, min(max(block // 256, 1), 8)


def _slice(n_rows: int, n: int, layouts: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(columns a program stores, programs a row). A few rows (decode) spread each row over
    programs of _SLICE columns, every one of them summing the whole row's squares (from cache)
    and rounding its own chunks; more rows, one program a row."""
    block = triton.next_power_of_2(n)
    whole = n % _SLICE == 0 and all(_SLICE % (w * g) == 0 for w, g in layouts)
    if n_rows > _SLICED_ROWS or n <= _SLICE or not whole:
        return block, 1
    return _SLICE, n // _SLICE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim; returns a new contiguous tensor of x's shape and dtype.

    x: [T, N] rows, or [T, heads, head_dim] for QK-norm (each head over head_dim, weight
    [head_dim]). Only the last dim must be contiguous, so q/k views of a fused QKV output work.
    """
    if x.dim() not in (2, 3):
        raise ValueError(
            f"rms_norm: x must be [T, N] or [T, heads, head_dim], got {tuple(x.shape)}"
        )
    n = x.shape[-1]
    _check_weight(x, weight, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows, n_heads = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    if out.numel() == 0:
        return out
    if n_heads > 65535:
        raise ValueError(f"rms_norm: {n_heads} heads exceed the grid limit of 65535")
    stride_h = x.stride(1) if x.dim() == 3 else 0
    block, num_warps = _launch_config(n)
    cols, slices = _slice(n_rows * n_heads, n, ())
    early = pdl(x.device, _rms_norm_kernel)
    _rms_norm_kernel[(n_rows, n_heads, slices)](
        x, x, weight, out, out, *[x] * 6, x.stride(0), stride_h, 0, n, eps,
        HAS_RESIDUAL=False, BLOCK_N=block, SLICE=cols, PDL=early,
        num_warps=num_warps, **launch_kw(early),
    )  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; both new contiguous [T, N] tensors.

    The sum is taken in float32 and rounded to x's dtype; the norm reads that rounded sum, so
    the result equals rms_norm(new_residual) exactly as the unfused code computes it.
    """
    normed, new_residual, _ = add_rms_norm_int8(x, residual, weight, eps, ())
    return normed, new_residual


def add_rms_norm_int8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    layouts: tuple[tuple[int, int], ...],
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """add_rms_norm (rms_norm with residual None: then x is returned as the residual), and for
    up to ROUND_ROWS rows the normed rows rounded to int8 in the same launch for each (W, G) of
    layouts (at most two): (normed, new_residual, {(W, G): (xq, xd, xs)} as
    int8_activations.prepare_int8 returns them for a weight of that layout: one row's, or
    [rows, ...] of each). More rows, or no layouts: an empty dict."""
    if x.dim() != 2:
        raise ValueError(f"add_rms_norm: x must be [T, N], got {tuple(x.shape)}")
    has_res = residual is not None
    if has_res and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    if has_res and (residual.device != x.device or residual.stride(-1) != 1):
        raise ValueError("add_rms_norm: residual must be on x's device with a contiguous last dim")
    if len(layouts) > 2:
        raise ValueError(f"add_rms_norm_int8: at most two layouts, got {layouts}")
    n = x.shape[-1]
    _check_weight(x, weight, n)
    if any(n % (w * g) for w, g in layouts):
        raise ValueError(f"add_rms_norm_int8: rows of {n} are not whole chunks of {layouts}")
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device) if has_res else x
    rounded = {}
    m = x.shape[0]
    if 1 <= m <= ROUND_ROWS:
        lead = m if m > 1 else 0  # one row: the single-row buffers the rows GEMV reads
        rounded = {layout: int8_buffers_for(n, *layout, x.device, lead) for layout in layouts}
    if x.numel() == 0:
        return normed, new_residual, {}
    bufs = [t for r in rounded.values() for t in r] + [x] * (6 - 3 * len(rounded))
    shapes = [v for layout in rounded for v in layout] + [32, 8] * (2 - len(rounded))
    several = m > 1 and bool(rounded)
    strides = [0] * 4  # with several rows: row t's codes at t times each buffer's row stride
    if several:
        rows = [v for xq, xd, _ in rounded.values() for v in (xq.stride(0), xd.stride(0))]
        strides[: len(rows)] = rows
    block, num_warps = _launch_config(n)
    cols, slices = _slice(m, n, tuple(rounded))
    early = pdl(x.device, _rms_norm_kernel)
    _rms_norm_kernel[(x.shape[0], 1, slices)](
        x, residual if has_res else x, weight, normed, new_residual, *bufs, x.stride(0), 0,
        residual.stride(0) if has_res else 0, n, eps, HAS_RESIDUAL=has_res, BLOCK_N=block,
        SLICE=cols, PDL=early, ROUND=len(rounded), W1=shapes[0], G1=shapes[1], W2=shapes[2],
        G2=shapes[3], stride_r1=strides[0], stride_s1=strides[1], stride_r2=strides[2],
        stride_s2=strides[3], ROUND_ROWS_AT=several,
        num_warps=num_warps, **launch_kw(early),
    )  # fmt: skip
    return normed, new_residual, rounded
