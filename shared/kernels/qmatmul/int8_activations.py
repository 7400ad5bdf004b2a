"""Activations rounded to int8 for the int8-activation GEMVs (packed_int8, packed_int8_tile).

Per sub-block of the weight's layout (W elements; G sub-blocks a chunk), as llama.cpp's q8_1
blocks: one scale ``max|x| / 127``, codes rounded half away from zero, and the float sum of the
sub-block (for the weights' offsets). The codes are stored as words ``xq[c, a, j]`` (byte t:
element ``W*j + 4a + t`` of chunk c), so that a GEMV thread's four words of a weight group meet
their activations in one word per field.

``round_blocks`` is the one implementation: ``quantize_x_kernel`` runs it once per chunk
(``quantize_chunk``, a launch of its own before the GEMV); a GEMV with ``QX`` runs it for its
own chunks in its prologue (no launch: every program of a split rounds the same chunks and
stores the same words); at batch 1 the RMSNorm (``norm.add_rms_norm_int8``), the decode
attention's combine pass (a head's sub-blocks) and the gated rows GEMV
(``split_tickets.round_gated``) run it on the values they store, for the GEMVs that read them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.gdc import launch_kw, launch_next, pdl, wait_prev
from shared.kernels.qmatmul.layout import PackedWeight
from shared.kernels.qmatmul.packed_gemm import fields

__all__ = [
    "int8_buffers",
    "int8_buffers_for",
    "int8_layout",
    "prepare_int8",
    "quantize_chunk",
    "quantize_x_kernel",
    "round_blocks",
]


@triton.jit
def _codes(x, amax):
    """x float32 -> int32 codes in -127..127 with the step amax / 127 (amax broadcast to x):
    round to nearest, half away from zero."""
    v = x * tl.where(amax > 0, 127.0 / amax, 0.0)
    return tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int32)


@triton.jit
def _round(x):
    """Sub-blocks along x's last axis (float32) -> (codes, max|x| a sub-block): one step a
    sub-block."""
    amax = tl.max(tl.abs(x), axis=-1)
    return _codes(x, tl.expand_dims(amax, -1)), amax


@triton.jit
def round_blocks(x, b0, b1, xq_ptr, xd_ptr, xs_ptr, W: tl.constexpr, G: tl.constexpr):
    """Sub-blocks b0, b0 + 1, ... of a row (x: [B, W] float32; sub-block b is field b % G of
    chunk b // G), those below b1 stored: int8 codes as words ``xq[c, a, j]``, the scale
    ``xd[c, j] = max|x| / 127`` and the float sum ``xs[c, j]`` of each sub-block."""
    B: tl.constexpr = x.shape[0]
    q, amax = _round(x)
    q = q & 0xFF
    e, o = tl.split(tl.reshape(q, (B, W // 4, 2, 2)))  # byte t = 2 * (t // 2) + t % 2
    q0, q2 = tl.split(e)
    q1, q3 = tl.split(o)
    word = q0 | (q1 << 8) | (q2 << 16) | (q3 << 24)  # [B, W / 4]
    b = b0 + tl.arange(0, B)
    live = b < b1
    at = ((b // G)[:, None] * (W // 4) + tl.arange(0, W // 4)[None, :]) * G + (b % G)[:, None]
    tl.store(xq_ptr + at, word, mask=live[:, None])
    tl.store(xd_ptr + b, amax / 127.0, mask=live)
    tl.store(xs_ptr + b, tl.sum(x, axis=-1), mask=live)


@triton.jit
def quantize_chunk(x_ptr, xq_ptr, xd_ptr, xs_ptr, c, W: tl.constexpr, G: tl.constexpr):
    """Chunk c of x (W * G elements, sub-block j = elements W*j .. W*j + W - 1) rounded by
    round_blocks."""
    j = tl.arange(0, G)[:, None]
    x = tl.load(x_ptr + c * (W * G) + j * W + tl.arange(0, W)[None, :]).to(tl.float32)
    round_blocks(x, c * G, (c + 1) * G, xq_ptr, xd_ptr, xs_ptr, W, G)


@triton.jit
def quantize_x_kernel(
    x_ptr, xq_ptr, xd_ptr, xs_ptr, stride_x, stride_q, stride_s, W: tl.constexpr,
    G: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Chunk ``program_id(0)`` of row ``program_id(1)`` (the rows' strides: x's elements, the
    words', the scales'); PDL: launched early (``gdc``)."""
    launch_next(PDL)
    wait_prev(PDL)
    r = tl.program_id(1)
    quantize_chunk(x_ptr + r * stride_x, xq_ptr + r * stride_q, xd_ptr + r * stride_s,
                   xs_ptr + r * stride_s, tl.program_id(0), W, G)  # fmt: skip


def int8_layout(pw: PackedWeight) -> tuple[int, int]:
    """(W, G): the sub-block size and the sub-blocks a chunk the activations of pw round to."""
    f = fields(pw)
    return f["W"], f["G"]


def int8_buffers_for(
    k: int, w: int, g: int, device: torch.device, m: int = 0
) -> tuple[torch.Tensor, ...]:
    """Empty (xq, xd, xs) for a row of k activations in layout (w, g); m > 0: for m rows
    ([m, k / 4] words, [m, k / w] scales and sums)."""
    lead = (m,) if m else ()
    xq = torch.empty(*lead, k // 4, dtype=torch.int32, device=device)
    xd = torch.empty(*lead, k // w, dtype=torch.float32, device=device)
    return xq, xd, torch.empty_like(xd)


def int8_buffers(x: torch.Tensor, pw: PackedWeight) -> tuple[torch.Tensor, ...]:
    """Empty (xq, xd, xs) for x [K] over pw's layout."""
    return int8_buffers_for(pw.shape[1], *int8_layout(pw), x.device)


def prepare_int8(x: torch.Tensor, pw: PackedWeight) -> tuple[torch.Tensor, ...]:
    """x [K] or [1, K] -> (xq, xd, xs) for the int8 GEMVs over pw's layout ([K / 4],
    [K / W] twice); x [M, K], M > 1 -> the same for each row ([M, K / 4], [M, K / W] twice:
    packed_int8_rows_batch). One small launch."""
    w, g = int8_layout(pw)
    m = x.shape[0] if x.dim() == 2 and x.shape[0] != 1 else 0
    xq, xd, xs = int8_buffers_for(pw.shape[1], w, g, x.device, m)
    if x.numel() == 0:
        return xq, xd, xs
    strides = (x.stride(0), xq.stride(0), xd.stride(0)) if m else (0, 0, 0)
    early = pdl(x.device, quantize_x_kernel)
    quantize_x_kernel[(xd.shape[-1] // g, max(m, 1))](
        x, xq, xd, xs, *strides, W=w, G=g, PDL=early, num_warps=1, **launch_kw(early)
    )  # fmt: skip
    return xq, xd, xs
