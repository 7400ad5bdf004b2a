"""Packed quantized weight -> dense ``[N, K]`` in the activation dtype, on the GPU in one launch.

For prefill-sized batches a dense matmul (cuBLAS on the tensor cores) over a dequantized copy
beats dequantizing inside the GEMM's main loop: the copy costs one pass over the weight, the
matmul then runs at the dense rate. ``packed_matmul`` takes this path when its tile config says
``DEQUANT`` (the tuner times it against the fused GEMM for the prefill bucket; not the default
until it is measured faster on a device).

Each value is the reference dequantization (``unpack``) rounded to the output dtype, as the fused
GEMM and the dense reference round it (a zero may come out +0.0 where the reference has -0.0).
Reference: ``unpack(pw).to(dtype)`` (tests/test_kernel_packed_dequant.py).

``dequantize_packed_rows``: the same for some rows only, gathered by index in the same launch
(a token embedding's lookup: at batch 1 torch dequantized the row in a few dozen small
launches, about 60 us a step with their gaps on the H200, BENCHMARKS.md (ab)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.device import interpreted
from shared.kernels.qmatmul.layout import CHUNK, PackedWeight
from shared.kernels.qmatmul.packed_chunk import MAGIC, group, load_chunk, load_meta
from shared.kernels.qmatmul.packed_gemm import fields, planes, strides
from shared.kernels.rounding import to_dtype

__all__ = ["dequantize_packed", "dequantize_packed_rows"]


@triton.jit
def _dequant_kernel(
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [N, K] ([len(ids), K] with GATHER)
    ids_ptr,  # GATHER: the rows to dequantize (int64)
    N, stride_q, stride_s, stride_d, stride_o,
    magic,  # packed_chunk.MAGIC
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R32: tl.constexpr,  # row-interleaved planes (packed_rows)
    INTERPRETED: tl.constexpr,
    GATHER: tl.constexpr = False,  # output row i is weight row ids[i] (N: len(ids))
):  # fmt: skip
    at = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = at < N
    rows = at
    if GATHER:
        rows = tl.load(ids_ptr + at, mask=nmask, other=0)
    c = tl.program_id(1)
    w, wh, h = load_chunk(R32, HI, q_ptr, hi_ptr, rows, nmask, c, stride_q, W)
    s0, s1, m0, m1, d, dmin = load_meta(
        R32, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
    )
    i = tl.arange(0, W)
    out = out_ptr + at[:, None] * stride_o + c * (W * G) + i[None, :]
    for j in tl.static_range(G):
        val = group(QTYPE, HI, j, w, wh, h, s0, s1, m0, m1, d, dmin, magic)
        val = to_dtype(val, out_ptr.dtype.element_ty, INTERPRETED)
        tl.store(out + j * W, val, mask=nmask[:, None])


def _launch(pw: PackedWeight, out: torch.Tensor, ids: torch.Tensor | None, block_n: int,
            num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """_dequant_kernel over out's rows: pw's rows in order, or rows `ids` (GATHER)."""
    n = out.shape[0]
    grid = (triton.cdiv(n, block_n), pw.shape[1] // CHUNK[pw.qtype])
    _dequant_kernel[grid](
        *planes(pw), out, out if ids is None else ids, n, *strides(pw), out.stride(0), MAGIC,
        **fields(pw), BLOCK_N=block_n, R32=pw.rows32, INTERPRETED=interpreted(_dequant_kernel),
        GATHER=ids is not None, num_warps=num_warps,
    )  # fmt: skip
    return out


def dequantize_packed(
    pw: PackedWeight, dtype: torch.dtype, out: torch.Tensor | None = None, block_n: int = 32
) -> torch.Tensor:
    """``unpack(pw)`` rounded to dtype, ``[N, K]`` (into `out` when given)."""
    n, k = pw.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=pw.q.device)
    elif out.shape != (n, k) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"dequantize_packed: out must be [{n}, {k}] {dtype} with unit last stride")
    return _launch(pw, out, None, block_n)


def dequantize_packed_rows(pw: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``unpack(pw)[ids].to(dtype)``, ``[len(ids), K]``, dequantizing only those rows (a token
    embedding's lookup); ids: int64 on pw's device, each in [0, N) (not checked: that would
    wait for the device)."""
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"dequantize_packed_rows: ids must be 1-D int64, got {ids.dtype} "
                         f"{tuple(ids.shape)}")  # fmt: skip
    out = torch.empty((ids.shape[0], pw.shape[1]), dtype=dtype, device=pw.q.device)
    if ids.shape[0] == 0:
        return out
    block_n = min(32, triton.next_power_of_2(ids.shape[0]))
    return _launch(pw, out, ids.contiguous(), block_n, 4 if block_n >= 16 else 1)
