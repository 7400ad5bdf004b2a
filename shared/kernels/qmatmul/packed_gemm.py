"""The decode-batch and prefill GEMM over a packed quantized weight (two activation rows and up).

A program owns a ``[BLOCK_M, BLOCK_N]`` output tile, rounds each dequantized field of a chunk
(``packed_chunk.group``) to the activation dtype (as the dense reference rounds its dequantized
weight) and accumulates ``tl.dot`` products on the tensor cores in float32: one dot per field
(K = W), or with ``WIDE`` one per chunk (K = W * G: the fields joined into one tile, so one
tensor-core step and barrier a chunk instead of G). When the output tiles leave SMs idle (decode
batches: N / BLOCK_N programs would each walk all of K) the chunk loop is split over a third
grid axis and the float32 partials are added by ``sum_splits_kernel``.

Used through ``packed_matmul``; reference ``x @ unpack(pw).T`` (tests/test_kernel_packed_matmul.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.activation import _SQRT_2_OVER_PI, _gelu_tanh, _silu
from shared.kernels.device import num_sms
from shared.kernels.qmatmul.layout import CHUNK, WORDS, PackedWeight
from shared.kernels.qmatmul.packed_chunk import group, load_chunk, load_meta
from shared.kernels.rounding import to_dtype

SQRT_2_OVER_PI = tl.constexpr(_SQRT_2_OVER_PI)

__all__ = [
    "SMALL_TILE",
    "auto_split",
    "fields",
    "gated",
    "gemm_tile",
    "launch_gemm",
    "launch_split",
    "planes",
    "store_tile",
    "strides",
    "sum_splits_kernel",
]


def planes(pw: PackedWeight) -> tuple[torch.Tensor, ...]:
    # absent planes are passed as q (never read: the kernel's QTYPE branch skips them)
    return tuple(t if t is not None else pw.q for t in (pw.q, pw.hi, pw.sc, pw.mn, pw.d, pw.dmin))


def strides(pw: PackedWeight) -> tuple[int, int, int]:
    sc = pw.sc if pw.sc is not None else pw.d
    return pw.q.stride(0), sc.stride(0), pw.d.stride(0)


def fields(pw: PackedWeight) -> dict[str, int]:
    words = WORDS[pw.qtype]
    hi = pw.hi is not None
    return {"QTYPE": int(pw.qtype), "HI": hi, "W": words, "G": CHUNK[pw.qtype] // words}


@triton.jit
def gated(g, u, ACT: tl.constexpr):
    """act(gate) * up in float32: ACT 1 SiLU, 2 GELU (tanh approximation)."""
    if ACT == 1:  # noqa: SIM108 (a plain constexpr branch compiles everywhere)
        a = _silu(g)
    else:
        a = _gelu_tanh(g, SQRT_2_OVER_PI)
    return a * u


@triton.jit
def sum_splits_kernel(
    part_ptr, out_ptr, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr
):
    """out[i] = sum_s part[s, i] in float32, stored in out's dtype (one launch for split-K).
    With ACT the partials hold interleaved gate/up outputs (gate at 2i, up at 2i + 1) and
    out[i] = act(gate) * up, i < N."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if ACT:
        up = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + s * (2 * N) + 2 * cols, mask=mask, other=0.0)
            up += tl.load(part_ptr + s * (2 * N) + 2 * cols + 1, mask=mask, other=0.0)
        acc = gated(acc, up, ACT)
    else:
        for s in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + s * N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_tile(
    QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
    w, wh, h, s0, s1, m0, m1, d, dmin,
):  # fmt: skip
    """All G fields of a chunk as one [BLOCK_N, W * G] float32 tile in the chunk's element
    order (column W * j + i: field j of word i). Each join appends an axis of 2, so after the
    joins the field's bits run from the first new axis (bit 0) to the last: reversing those
    axes in front of the words' axis puts field j at the major position."""
    mg: tl.constexpr = 0x4B000000
    f0 = group(QTYPE, HI, 0, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
    f1 = group(QTYPE, HI, 1, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
    f2 = group(QTYPE, HI, 2, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
    f3 = group(QTYPE, HI, 3, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
    t = tl.join(tl.join(f0, f1), tl.join(f2, f3))  # [BN, W, b0, b1]
    if G == 4:
        t = tl.permute(t, (0, 3, 2, 1))
    else:
        f4 = group(QTYPE, HI, 4, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
        f5 = group(QTYPE, HI, 5, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
        f6 = group(QTYPE, HI, 6, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
        f7 = group(QTYPE, HI, 7, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
        t = tl.join(t, tl.join(tl.join(f4, f5), tl.join(f6, f7)))  # [BN, W, b0, b1, b2]
        if G == 8:
            t = tl.permute(t, (0, 4, 3, 2, 1))
        else:
            f8 = group(QTYPE, HI, 8, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            f9 = group(QTYPE, HI, 9, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            f10 = group(QTYPE, HI, 10, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            f11 = group(QTYPE, HI, 11, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            f12 = group(QTYPE, HI, 12, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            f13 = group(QTYPE, HI, 13, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            f14 = group(QTYPE, HI, 14, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            f15 = group(QTYPE, HI, 15, w, wh, h, s0, s1, m0, m1, d, dmin, mg)
            upper = tl.join(tl.join(f8, f9), tl.join(f10, f11))
            t = tl.join(t, tl.join(upper, tl.join(tl.join(f12, f13), tl.join(f14, f15))))
            t = tl.permute(t, (0, 5, 4, 3, 2, 1))
    return tl.reshape(t, (w.shape[0], W * G))


@triton.jit
def _gemm_step(
    acc, c, x_rows, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask,
    stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
    WIDE: tl.constexpr, R32: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Chunk c into acc: one dot a field (K = W, x_rows at column 0 of the field), or with WIDE
    one dot of K = W * G (x_rows at the row starts): fewer, larger tensor-core steps."""
    w, wh, h = load_chunk(R32, HI, q_ptr, hi_ptr, rows, nmask, c, stride_q, W)
    s0, s1, m0, m1, d, dmin = load_meta(
        R32, QTYPE, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows, nmask, c, stride_s, stride_d
    )
    if WIDE:
        tile = _chunk_tile(QTYPE, HI, W, G, w, wh, h, s0, s1, m0, m1, d, dmin)
        cols = c * (W * G) + tl.arange(0, W * G)
        xs = tl.load(x_rows + cols[None, :], mask=mmask[:, None], other=0.0)
        acc = _dot_acc(acc, xs, tile, INTERPRETED)
    else:
        for j in tl.static_range(G):
            # the magic as an immediate: in a register it made this loop longer (kernel_sass)
            val = group(QTYPE, HI, j, w, wh, h, s0, s1, m0, m1, d, dmin, 0x4B000000)
            xj = tl.load(x_rows + c * (W * G) + j * W, mask=mmask[:, None], other=0.0)
            acc = _dot_acc(acc, xj, val, INTERPRETED)
    return acc


@triton.jit
def _gemm_kernel(
    x_ptr,  # [M, K] activations
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [M, N], or [SPLITS, M, N] float32 partials (split-K)
    M, N, n_chunks, per_split, stride_xm, stride_om, stride_os, stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDE: tl.constexpr,  # one dot of K = W * G a chunk (_gemm_chunk_wide)
    R32: tl.constexpr,  # row-interleaved planes (packed_rows)
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs; store act(gate) * up ([M, N / 2])
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows_m, rows, mmask, nmask, c0, c1 = gemm_tile(M, N, n_chunks, per_split, BLOCK_M, BLOCK_N)
    i = tl.arange(0, W)
    x_rows = x_ptr + rows_m[:, None] * stride_xm + i[None, :]
    if WIDE:
        x_rows = x_ptr + rows_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:
        c = c0
        while c < c1:
            acc = _gemm_step(
                acc, c, x_rows, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows,
                nmask, stride_q, stride_s, stride_d, QTYPE, HI, W, G, WIDE, R32, INTERPRETED,
            )  # fmt: skip
            c += 1
    else:
        for c in range(c0, c1):
            acc = _gemm_step(
                acc, c, x_rows, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, rows,
                nmask, stride_q, stride_s, stride_d, QTYPE, HI, W, G, WIDE, R32, INTERPRETED,
            )  # fmt: skip
    store_tile(out_ptr, acc, rows_m, rows, M, N, stride_om, stride_os, BLOCK_M, BLOCK_N, ACT)


@triton.jit
def gemm_tile(M, N, n_chunks, per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMM program's output tile and chunk range: (activation rows, weight rows, their
    masks, first chunk, end chunk). The grid's m varies fastest, so programs that run together
    share one weight tile; program_id(2) is the split."""
    rows_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c0 = tl.program_id(2) * per_split
    return rows_m, rows, rows_m < M, rows < N, c0, tl.minimum(c0 + per_split, n_chunks)


@triton.jit
def store_tile(
    out_ptr, acc, rows_m, rows, M, N, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    """A GEMM program's float32 [BLOCK_M, BLOCK_N] tile into out ([M, N], or its split's slice
    of the [SPLITS, M, N] partials), or with ACT the gated activation of its gate/up column
    pairs ([M, N / 2]; never split)."""
    mmask = rows_m < M
    if ACT:
        g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        half = tl.program_id(1).to(tl.int64) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = out_ptr + rows_m[:, None] * stride_om + half[None, :]
        ok = mmask[:, None] & (half < N // 2)[None, :]
        tl.store(out, gated(g, u, ACT).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        out = out_ptr + tl.program_id(2) * stride_os + rows_m[:, None] * stride_om + rows[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & (rows < N)[None, :])


@triton.jit
def _dot_acc(acc, x, w, INTERPRETED: tl.constexpr):
    """acc + x @ w.T with w (float32 values) rounded to x's dtype first."""
    if x.dtype == tl.float32:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    if INTERPRETED:
        # its 16-bit dots multiply bit patterns: multiply the rounded values in float32
        wr = to_dtype(w, x.dtype, INTERPRETED).to(tl.float32)
        return tl.dot(x.to(tl.float32), tl.trans(wr), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


# fits any type and activation dtype
SMALL_TILE = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}


def launch_gemm(x, pw, out, cfg, interp, act: int = 0) -> None:
    """out = x @ unpack(pw).T ([M, N]), or with act the gated activation of its interleaved
    gate/up columns ([M, N / 2])."""

    def launch(grid, target, n_chunks, per_split, epilogue):
        _gemm_kernel[grid](
            x, *planes(pw), target, out.shape[0], pw.shape[0], n_chunks, per_split, x.stride(0),
            target.stride(-2), out.shape[0] * pw.shape[0], *strides(pw), **fields(pw),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], WIDE=bool(cfg.get("WIDE")),
            ACT=epilogue, R32=pw.rows32, INTERPRETED=interp, num_warps=cfg.get("num_warps", 4),
            num_stages=cfg.get("num_stages", 2),
        )  # fmt: skip

    launch_split(pw, out, cfg, act, launch)


def launch_split(pw: PackedWeight, out: torch.Tensor, cfg: dict, act: int, launch) -> None:
    """A GEMM over cfg's output tiles (BLOCK_M x BLOCK_N), with its chunk loop split over a
    third grid axis when the tiles alone leave SMs idle (or as cfg's SPLIT_K says):
    ``launch(grid, target, n_chunks, per_split, act)`` writes out itself, or float32 partials
    that one more launch adds (and activates)."""
    m, n = out.shape[0], pw.shape[0]
    n_chunks = pw.shape[1] // CHUNK[pw.qtype]
    tiles = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    splits = cfg.get("SPLIT_K") or auto_split(
        tiles[0] * tiles[1], out.device, per_sm=2, most=min(8, n_chunks // 2)
    )
    per_split = triton.cdiv(n_chunks, splits)
    splits = triton.cdiv(n_chunks, per_split)
    if splits == 1:
        launch((*tiles, 1), out, n_chunks, per_split, act)
        return
    target = torch.empty((splits, m, n), dtype=torch.float32, device=out.device)
    launch((*tiles, splits), target, n_chunks, per_split, 0)
    grid = (triton.cdiv(out.numel(), 1024),)
    sum_splits_kernel[grid](target, out, out.numel(), SPLITS=splits, BLOCK=1024, ACT=act)


def auto_split(tiles: int, device: torch.device, per_sm: int, most: int) -> int:
    """Split-K when the output tiles alone leave SMs idle: enough splits for about per_sm
    programs an SM, at most `most` (each program would otherwise walk all of K, 16-56 chunks
    for Llama-3-8B, one chunk after another)."""
    if device.type != "cuda":
        return 1
    target = per_sm * num_sms(device)
    if tiles >= target:
        return 1
    return max(1, min(triton.cdiv(target, tiles), most))
