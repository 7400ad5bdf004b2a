"""Quantized GEMV/skinny GEMM straight from GGUF K-quant blocks: ``x @ dequantize(raw).T``.

Owns the Triton kernels for Q4_K, Q5_K and Q6_K weights kept on the device in block format
(``raw``: uint8 ``[N, K / 256 * type_size]``) and their Python wrapper. Reference:
``shared.quant.dequantize`` followed by a float32 matmul (see tests/test_kernel_qgemv_kquants.py).

Decode is memory bound, so the design is "read every weight byte once": a program owns
``BLOCK_N`` output rows and a slice of ``BLOCK_M`` activation rows, loops over the 256-element
super-blocks of its slice of K, unpacks the 6-bit (Q4_K/Q5_K) or int8 (Q6_K) sub-block scales
once per super-block and row, and applies them after the inner sum over a sub-block::

    y += (d * sc) * sum_j q_j x_j - (dmin * m) * sum_j x_j

all in float32. The inner sum is a broadcast multiply-reduce for ``BLOCK_M < 16`` and a
``tl.dot`` (tensor cores; IEEE fp32 when x is fp32) from 16 rows up. When the row tiles alone
cannot fill the device (few output rows, long K) the super-block loop is split over a second
grid axis and the float32 partial sums are added afterwards (split-K).

Tile sizes are constexpr with fixed defaults chosen by M; per-device autotuning is future work
(tools/bench_qgemv.py reports GB/s against the copy bandwidth to guide it).
Q2_K and Q3_K are not implemented yet and raise NotImplementedError.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from shared.kernels.device import interpreted, num_sms
from shared.kernels.rounding import to_dtype

__all__ = ["KQUANT_TYPES", "quant_gemv_kquant"]

_T = GGMLQuantizationType
QK_K = 256
# qtype -> bytes per 256-element super-block
_TYPE_SIZE = {_T.Q4_K: 144, _T.Q5_K: 176, _T.Q6_K: 210}
KQUANT_TYPES: frozenset[GGMLQuantizationType] = frozenset(_TYPE_SIZE)
_NOT_YET = frozenset({_T.Q2_K, _T.Q3_K})
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_M = 64


@triton.jit
def _fp16_at(blk_ptrs, offset: tl.constexpr, row_mask):
    """blk_ptrs: [BLOCK_N] uint8 pointers to super-block starts. The little-endian fp16 at
    byte `offset`, as float32; blocks are only 2-byte aligned, so assemble it from bytes."""
    lo = tl.load(blk_ptrs + offset, mask=row_mask, other=0).to(tl.uint16)
    hi = tl.load(blk_ptrs + offset + 1, mask=row_mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(blk_ptrs, offset: tl.constexpr, row_mask):
    """[BLOCK_N] uint8 pointers -> byte `offset` of each super-block as int32."""
    return tl.load(blk_ptrs + offset, mask=row_mask, other=0).to(tl.int32)


@triton.jit
def _sub_dot(x_sub, q, USE_DOT: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x_sub: [BLOCK_M, S] activation dtype; q: [BLOCK_N, S] float32 small integers (exact in
    any float dtype). Returns sum_j x[m, j] * q[n, j] as [BLOCK_M, BLOCK_N] float32."""
    if USE_DOT:
        if INTERPRETED:  # its bf16 dot would multiply bit patterns as uint16
            return tl.dot(x_sub.to(tl.float32), tl.trans(q), input_precision="ieee")
        elif IEEE:
            return tl.dot(x_sub, tl.trans(q.to(x_sub.dtype)), input_precision="ieee")
        else:
            return tl.dot(x_sub, tl.trans(q.to(x_sub.dtype)))
    else:
        prod = x_sub.to(tl.float32)[:, None, :] * q[None, :, :]
        return tl.sum(prod, axis=2)


@triton.jit
def _kquant_gemv_kernel(
    x_ptr,  # [M, K] float32/float16/bfloat16, last dim contiguous
    raw_ptr,  # [N, K / 256 * TYPE_SIZE] uint8, last dim contiguous
    out_ptr,  # [SPLIT_K, M, N] float32 partial sums (or the output dtype when SPLIT_K == 1)
    M,
    N,
    n_super,  # K / 256
    blocks_per_split,  # super-blocks per program along grid axis 2
    stride_xm,  # int64
    stride_rn,  # int64
    stride_os,  # int64
    stride_om,  # int64
    QTYPE: tl.constexpr,  # 12 = Q4_K, 13 = Q5_K, 14 = Q6_K
    TYPE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,  # inner sums on tensor cores (BLOCK_M >= 16)
    IEEE: tl.constexpr,  # x is fp32: keep the dot in full fp32, not tf32
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET=1 on the CPU: work around its gaps
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rows_n < N
    m_mask = rows_m < M
    row_ptrs = raw_ptr + rows_n * stride_rn  # [BLOCK_N]
    x_rows = x_ptr + rows_m * stride_xm  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    kb_start = pid_s * blocks_per_split
    kb_stop = tl.minimum(kb_start + blocks_per_split, n_super)
    if INTERPRETED:
        # The interpreter cannot range() over tensor bounds with numpy >= 2.4 (triton#9171).
        kb = kb_start
        while kb < kb_stop:
            acc += _superblock(
                row_ptrs, x_rows, kb, n_mask, m_mask,
                QTYPE, TYPE_SIZE, BLOCK_M, BLOCK_N, USE_DOT, IEEE, INTERPRETED,
            )  # fmt: skip
            kb += 1
    else:
        for kb in range(kb_start, kb_stop):
            acc += _superblock(
                row_ptrs, x_rows, kb, n_mask, m_mask,
                QTYPE, TYPE_SIZE, BLOCK_M, BLOCK_N, USE_DOT, IEEE, INTERPRETED,
            )  # fmt: skip

    out_ptrs = out_ptr + pid_s * stride_os + rows_m[:, None] * stride_om + rows_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptrs, to_dtype(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _superblock(
    row_ptrs,  # [BLOCK_N] uint8 pointers to the weight rows
    x_rows,  # [BLOCK_M] pointers to the activation rows
    kb,  # super-block index along K
    n_mask,
    m_mask,
    QTYPE: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Super-block kb of every owned row -> [BLOCK_M, BLOCK_N] float32 contribution."""
    blk = row_ptrs + kb * TYPE_SIZE
    x_blk = x_rows + kb * 256
    if QTYPE == 14:
        return _q6_k_superblock(
            blk, x_blk, n_mask, m_mask, BLOCK_M, BLOCK_N, USE_DOT, IEEE, INTERPRETED
        )
    else:
        return _q45_k_superblock(
            blk, x_blk, n_mask, m_mask, QTYPE == 13, BLOCK_M, BLOCK_N, USE_DOT, IEEE, INTERPRETED
        )


@triton.jit
def _q45_k_superblock(
    blk,  # [BLOCK_N] uint8 pointers: d | dmin | scales[12] | (qh[32] if HAS_QH) | qs[128]
    x_blk,  # [BLOCK_M] pointers to the 256 activations of this super-block
    n_mask,
    m_mask,
    HAS_QH: tl.constexpr,  # Q5_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One Q4_K/Q5_K super-block -> [BLOCK_M, BLOCK_N] float32 contribution.

    Group g (64 elements) uses qs bytes 32g..32g+31: low nibbles are sub-block 2g, high
    nibbles sub-block 2g + 1; bit j of qh[i] is the fifth bit of element 32j + i.
    """
    QS: tl.constexpr = 16 + 32 * HAS_QH
    d = _fp16_at(blk, 0, n_mask)
    dmin = _fp16_at(blk, 2, n_mask)
    cols = tl.arange(0, 32)
    lane_mask = n_mask[:, None]
    if HAS_QH:
        qh = tl.load(blk[:, None] + 16 + cols[None, :], mask=lane_mask, other=0).to(tl.int32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in tl.static_range(4):
        qs = tl.load(blk[:, None] + (QS + 32 * g) + cols[None, :], mask=lane_mask, other=0)
        qs = qs.to(tl.int32)
        for nib in tl.static_range(2):
            j = 2 * g + nib
            # 6-bit scale/min of sub-block j (see shared/quant/kquants.unpack_scale_min_k4)
            if j < 4:
                sc = _byte_at(blk, 4 + j, n_mask) & 63
                mn = _byte_at(blk, 8 + j, n_mask) & 63
            else:
                packed = _byte_at(blk, 12 + j - 4, n_mask)
                sc = (packed & 15) | ((_byte_at(blk, j, n_mask) >> 6) << 4)
                mn = (packed >> 4) | ((_byte_at(blk, 4 + j, n_mask) >> 6) << 4)
            q = (qs >> (4 * nib)) & 15
            if HAS_QH:
                q = q | (((qh >> j) & 1) << 4)
            x_sub = tl.load(
                x_blk[:, None] + 32 * j + cols[None, :], mask=m_mask[:, None], other=0.0
            )
            dot = _sub_dot(x_sub, q.to(tl.float32), USE_DOT, IEEE, INTERPRETED)
            x_sum = tl.sum(x_sub.to(tl.float32), axis=1)
            scale = d * sc.to(tl.float32)
            offset = dmin * mn.to(tl.float32)
            part += dot * scale[None, :] - x_sum[:, None] * offset[None, :]
    return part


@triton.jit
def _q6_k_superblock(
    blk,  # [BLOCK_N] uint8 pointers: ql[128] | qh[64] | scales:int8[16] | d
    x_blk,  # [BLOCK_M] pointers to the 256 activations of this super-block
    n_mask,
    m_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One Q6_K super-block -> [BLOCK_M, BLOCK_N] float32 contribution.

    Sub-block s (16 elements) of half c = s // 8 covers elements 128c + 32p + 16h + i with
    p = (s % 8) // 2, h = s % 2: low nibble from ql[64c + 32(p % 2) + 16h + i] >> 4(p // 2),
    high bit pair from qh[32c + 16h + i] >> 2p.
    """
    d = _fp16_at(blk, 208, n_mask)
    cols = tl.arange(0, 16)
    lane_mask = n_mask[:, None]
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.static_range(2):
        for h in tl.static_range(2):
            qh = tl.load(blk[:, None] + (128 + 32 * c + 16 * h) + cols[None, :], mask=lane_mask)
            qh = qh.to(tl.int32)
            for r in tl.static_range(2):
                ql = tl.load(
                    blk[:, None] + (64 * c + 32 * r + 16 * h) + cols[None, :], mask=lane_mask
                )
                ql = ql.to(tl.int32)
                for nib in tl.static_range(2):
                    p = 2 * nib + r
                    s = 8 * c + 2 * p + h
                    sc = tl.load(blk + (192 + s), mask=n_mask, other=0)
                    sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
                    q = ((ql >> (4 * nib)) & 15) | (((qh >> (2 * p)) & 3) << 4)
                    x_sub = tl.load(
                        x_blk[:, None] + (128 * c + 32 * p + 16 * h) + cols[None, :],
                        mask=m_mask[:, None],
                        other=0.0,
                    )
                    dot = _sub_dot(x_sub, (q - 32).to(tl.float32), USE_DOT, IEEE, INTERPRETED)
                    part += dot * (d * sc)[None, :]
    return part


def _check(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> GGMLQuantizationType:
    try:
        resolved = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"quant_gemv_kquant: unknown GGML type id {int(qtype)}") from None
    if resolved in _NOT_YET:
        raise NotImplementedError(f"quant_gemv_kquant: {resolved.name} has no Triton kernel yet")
    if resolved not in KQUANT_TYPES:
        names = ", ".join(sorted(t.name for t in KQUANT_TYPES))
        raise ValueError(f"quant_gemv_kquant: {resolved.name} is not a K-quant; supported: {names}")
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"quant_gemv_kquant: x must be 2-D float, got {tuple(x.shape)} {x.dtype}")
    if raw.dim() != 2 or raw.dtype != torch.uint8:
        raise ValueError(
            f"quant_gemv_kquant: raw must be 2-D uint8, got {tuple(raw.shape)} {raw.dtype}"
        )
    if raw.device != x.device:
        raise ValueError(f"quant_gemv_kquant: raw on {raw.device}, x on {x.device}")
    m, k = x.shape
    if not 1 <= m <= _MAX_M:
        raise ValueError(f"quant_gemv_kquant: M={m} outside 1..{_MAX_M} (use dequant + matmul)")
    if k % QK_K:
        raise ValueError(f"quant_gemv_kquant: K={k} is not a multiple of {QK_K}")
    row_bytes = k // QK_K * _TYPE_SIZE[resolved]
    if raw.shape[1] != row_bytes:
        raise ValueError(
            f"quant_gemv_kquant: {resolved.name} rows of K={k} take {row_bytes} bytes, "
            f"raw has {raw.shape[1]}"
        )
    if x.stride(1) != 1 or raw.stride(1) != 1:
        raise ValueError(
            f"quant_gemv_kquant: last dims must be contiguous, x strides {x.stride()}, "
            f"raw strides {raw.stride()}"
        )
    return resolved


def _split_k(n_tiles: int, n_super: int, device: torch.device) -> int:
    # Split the super-block loop only when the row tiles leave SMs idle, keeping >= 8 blocks each.
    target = 4 * num_sms(device)
    if device.type != "cuda" or n_tiles >= target:
        return 1
    return max(1, min(target // n_tiles, n_super // 8))


def quant_gemv_kquant(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: int,
    out_dtype: torch.dtype | None = None,
    *,
    block_n: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ dequantize(raw, qtype, (N, K)).T`` -> ``[M, N]`` with float32 accumulation.

    x: ``[M, K]`` fp32/fp16/bf16 with M in 1..64; raw: uint8 ``[N, K / 256 * type_size]``
    (GGUF rows); qtype: Q4_K, Q5_K or Q6_K (Q2_K/Q3_K raise NotImplementedError).
    out_dtype defaults to x's dtype. block_n / split_k override the default tiling.
    """
    resolved = _check(x, raw, qtype)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"quant_gemv_kquant: out_dtype {out_dtype} is not a float dtype")
    m, k = x.shape
    n = raw.shape[0]
    n_super = k // QK_K
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if n == 0:
        return out
    block_m = max(triton.next_power_of_2(m), 1)
    use_dot = block_m >= 16
    if not use_dot:
        block_m = min(block_m, 8)
    block_n = block_n or (32 if use_dot or block_m > 2 else 64)
    n_tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    splits = split_k or _split_k(n_tiles, n_super, x.device)
    per_split = triton.cdiv(n_super, splits)
    splits = triton.cdiv(n_super, per_split)
    target = (
        out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    )
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    _kquant_gemv_kernel[grid](
        x, raw, target, m, n, n_super, per_split,
        x.stride(0), raw.stride(0), target.stride(0) if splits > 1 else 0, n,
        QTYPE=int(resolved), TYPE_SIZE=_TYPE_SIZE[resolved],
        INTERPRETED=interpreted(_kquant_gemv_kernel),
        BLOCK_M=block_m, BLOCK_N=block_n, USE_DOT=use_dot, IEEE=x.dtype == torch.float32,
        num_warps=4,
    )  # fmt: skip
    if splits > 1:
        out.copy_(target.sum(dim=0))
    return out
