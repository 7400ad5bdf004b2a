"""The decode-batch GEMM in fp16: Q4_K and Q6_K weights formed as fp16 tiles for one
tensor-core dot a chunk.

``packed_gemm`` forms every weight in float32 exactly (the reference's value) and rounds it to
the activation dtype: 10-14 instructions a weight (``tools/kernel_sass``), so a 64-row decode
batch took 9 ms for Llama-3-8B's 4.9 GB of Q4_K_M weights that HBM delivers in 1.2 ms. Here
two weights are formed at once in the two fp16 halves of a register (PTX ``f16x2``): fields j
and j + 4 of a packed word sit at bits 4j and 4j + 16, so one shift and one mask take both
codes, OR-ed into the mantissa of 1024.0 (``1024 + q`` in fp16, no conversion instruction);
subtracting 1024 (Q6_K: 1056, with the two high bits OR-ed in first) leaves the code exactly,
and one fused multiply-add (Q6_K: a multiply) applies the two sub-blocks' ``d * scale`` and
``dmin * min``, themselves formed the same way from the scale bytes once a row and chunk.
The tile's columns are in that register order (``chunk_order``); one small launch per call
converts the activations to fp16 (clamped to its range) and permutes them to match
(``prepare_x16``). Products are
summed in float32 on the tensor cores.

Each weight is rounded once to fp16 where the reference (float32 weight rounded to the bf16
activations' dtype) rounds it once to bf16: the result differs from ``x @ unpack(pw).T`` by
those roundings and summation order (tests). Offline (sm_90, 64 rows, 32-row tiles): 6.4
instructions a Q4_K weight and 8.7 a Q6_K one, against 10.1 and 14.2 for the WIDE tiles.
Under the Triton interpreter, which runs no inline assembly, integer and float32 arithmetic
computes the same roundings.
Reference: ``x @ unpack(pw).T`` (tests/test_kernel_packed_gemm16.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from shared.kernels.qmatmul.layout import WORDS, PackedWeight
from shared.kernels.qmatmul.packed_chunk import _words, entry, load_chunk
from shared.kernels.qmatmul.packed_gemm import (
    gemm_tile,
    launch_split,
    planes,
    store_tile,
    strides,
)
from shared.kernels.rounding import fp16_range

__all__ = ["F16_TYPES", "chunk_order", "launch_gemm16", "prepare_x16"]

F16_TYPES = frozenset({GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})
Q4_K = tl.constexpr(int(GGMLQuantizationType.Q4_K))
Q6_K = tl.constexpr(int(GGMLQuantizationType.Q6_K))


@triton.jit
def _half(t, H: tl.constexpr):
    """Half H of each word as an fp16 value (interpreter branches)."""
    return ((t >> (16 * H)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pairs16(lo, hi, dd, J: tl.constexpr, SIGNED: tl.constexpr, INTERPRETED: tl.constexpr):
    """Bytes J of lo and of hi (a row's sub-block scales J and J + 4) times the row's d, as an
    fp16 pair in one word (J's in the low half): an unsigned byte OR-ed into 1024.0's mantissa
    is 1024 + byte (a signed one, flipped: 1152 + byte), so subtracting that offset and one
    multiply give the product rounded once. dd: d's fp16 bits in both halves."""
    if INTERPRETED:
        b0 = (lo >> (8 * J)) & 0xFF
        b1 = (hi >> (8 * J)) & 0xFF
        if SIGNED:
            b0, b1 = (b0 ^ 0x80) - 0x80, (b1 ^ 0x80) - 0x80
        d = _half(dd, 0)
        a0 = (b0.to(tl.float32) * d).to(tl.float16).to(tl.int16, bitcast=True)
        a1 = (b1.to(tl.float32) * d).to(tl.float16).to(tl.int16, bitcast=True)
        return (a0.to(tl.int32) & 0xFFFF) | (a1.to(tl.int32) << 16)
    sel: tl.constexpr = J | ((J + 4) << 8)  # bytes 0 and 2: byte J of lo, byte J of hi
    if SIGNED:  # two's complement flipped: 128 + byte, then 1152.0 (0x6480) subtracted
        return tl.inline_asm_elementwise(
            f"""{{
            .reg .b32 t, k;
            prmt.b32 t, $1, $2, {sel};
            and.b32 t, t, 0x00FF00FF;
            xor.b32 t, t, 0x00800080;
            or.b32 t, t, 0x64006400;
            mov.b32 k, 0x64806480;
            sub.rn.f16x2 t, t, k;
            mul.rn.f16x2 $0, t, $3;
            }}""",
            "=r,r,r,r", [lo, hi, dd], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        f"""{{
        .reg .b32 t, k;
        mov.b32 k, 0x64006400;
        prmt.b32 t, $1, $2, {sel};
        lop3.b32 t, t, 0x00FF00FF, k, 0xEA;
        sub.rn.f16x2 t, t, k;
        mul.rn.f16x2 $0, t, $3;
        }}""",
        "=r,r,r,r", [lo, hi, dd], dtype=tl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _weights16(QTYPE: tl.constexpr, w, h2, a, b, J: tl.constexpr, INTERPRETED: tl.constexpr):
    """Fields J (bits 4J) and J + 4 (bits 4J + 16) of the words as fp16 weights, a and b the
    two sub-blocks' fp16 factors in one word each. Q4_K: ``q * a - b``. Q6_K: the code's two
    high bits come from h2 (bits 2J and 2J + 16, see ``_spread``), ``(code - 32) * a``."""
    if INTERPRETED:
        q0 = ((w >> (4 * J)) & 0xF).to(tl.float32)
        q1 = ((w >> (4 * J + 16)) & 0xF).to(tl.float32)
        if QTYPE == Q6_K:
            q0 += 16.0 * ((h2 >> (2 * J)) & 0x3).to(tl.float32) - 32.0
            q1 += 16.0 * ((h2 >> (2 * J + 16)) & 0x3).to(tl.float32) - 32.0
            return (q0 * _half(a, 0)).to(tl.float16), (q1 * _half(a, 1)).to(tl.float16)
        w0 = q0 * _half(a, 0) - _half(b, 0)
        return w0.to(tl.float16), (q1 * _half(a, 1) - _half(b, 1)).to(tl.float16)
    if QTYPE == Q6_K:
        return tl.inline_asm_elementwise(
            f"""{{
            .reg .b32 t, u, k;
            shr.u32 t, $2, {4 * J};
            shr.u32 u, $3, {2 * J};
            and.b32 u, u, 0x00030003;
            shl.b32 u, u, 4;
            lop3.b32 t, t, 0x000F000F, u, 0xEA;
            or.b32 t, t, 0x64006400;
            mov.b32 k, 0x64206420;
            sub.rn.f16x2 t, t, k;
            mul.rn.f16x2 t, t, $4;
            mov.b32 {{$0, $1}}, t;
            }}""",
            "=h,=h,r,r,r", [w, h2, a], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        f"""{{
        .reg .b32 t, u, k;
        mov.b32 k, 0x64006400;
        shr.u32 t, $2, {4 * J};
        lop3.b32 t, t, 0x000F000F, k, 0xEA;
        sub.rn.f16x2 t, t, k;
        neg.f16x2 u, $4;
        fma.rn.f16x2 t, t, $3, u;
        mov.b32 {{$0, $1}}, t;
        }}""",
        "=h,=h,r,r,r", [w, a, b], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _spread(h):
    """Q6_K's high-bit half-words (bits 2j, 2j + 1: field j) with fields 4..7 moved up by 8, so
    that fields J and J + 4 sit at bits 2J and 2J + 16."""
    h = h & 0xFFFF
    return (h & 0xFF) | ((h & 0xFF00) << 8)


@triton.jit
def _field_pair(
    QTYPE: tl.constexpr, w, h2, s_lo, s_hi, m_lo, m_hi, dd, ddmin, J: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Fields J and J + 4 of the words as fp16 weights [BLOCK_N, W, 2]."""
    a = _pairs16(s_lo, s_hi, dd, J, QTYPE == Q6_K, INTERPRETED)[:, None]
    b = a
    if QTYPE == Q4_K:
        b = _pairs16(m_lo, m_hi, ddmin, J, False, INTERPRETED)[:, None]
    return tl.join(*_weights16(QTYPE, w, h2, a, b, J, INTERPRETED))


@triton.jit
def _tile16(
    QTYPE: tl.constexpr, w, h, s0, m0, dd, ddmin, W: tl.constexpr, INTERPRETED: tl.constexpr
):
    """The chunk as one [BLOCK_N, 8 * W] fp16 tile in the order of ``chunk_order``: column
    8 i + 2 j + h holds element W (j + 4 h) + i (word i, field j + 4 h)."""
    s_lo, s_hi = s0.to(tl.int32), (s0 >> 32).to(tl.int32)
    m_lo, m_hi = m0.to(tl.int32), (m0 >> 32).to(tl.int32)
    h2 = _spread(h)
    t0 = _field_pair(QTYPE, w, h2, s_lo, s_hi, m_lo, m_hi, dd, ddmin, 0, INTERPRETED)
    t1 = _field_pair(QTYPE, w, h2, s_lo, s_hi, m_lo, m_hi, dd, ddmin, 1, INTERPRETED)
    t2 = _field_pair(QTYPE, w, h2, s_lo, s_hi, m_lo, m_hi, dd, ddmin, 2, INTERPRETED)
    t3 = _field_pair(QTYPE, w, h2, s_lo, s_hi, m_lo, m_hi, dd, ddmin, 3, INTERPRETED)
    t = tl.join(tl.join(t0, t1), tl.join(t2, t3))  # [BN, W, h, j0, j1]
    t = tl.permute(t, (0, 1, 4, 3, 2))  # j = j0 + 2 j1
    return tl.reshape(t, (w.shape[0], 8 * W))


@triton.jit
def _dup16(R32: tl.constexpr, ptr, rows, nmask, c, stride_d):
    """A row's fp16 factor of chunk c as its bits in both halves of a word."""
    at = entry(R32, rows, c, stride_d, 1)
    bits = tl.load(ptr.to(tl.pointer_type(tl.int16)) + at, mask=nmask, other=0)
    b = bits.to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _factors16(QTYPE: tl.constexpr, R32: tl.constexpr, d_ptr, dmin_ptr, rows, mask, c, stride_d):
    """Chunk c's d and dmin (``_dup16``). Q6_K: chunks of 128, d per 256, no dmin."""
    if QTYPE == Q4_K:
        dd = _dup16(R32, d_ptr, rows, mask, c, stride_d)
        return dd, _dup16(R32, dmin_ptr, rows, mask, c, stride_d)
    dd = _dup16(R32, d_ptr, rows, mask, c // 2, stride_d)
    return dd, dd


@triton.jit
def _step16(
    acc, c, x_rows, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, dd, ddmin, rows, nmask,
    stride_q, stride_s,
    QTYPE: tl.constexpr, W: tl.constexpr, R32: tl.constexpr, SWAP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """acc plus chunk c's products; dd, ddmin: its factors, loaded one chunk ahead by the
    caller (2-byte loads are not pipelined by Triton's cp.async stages: loaded in the step,
    every chunk would wait on them)."""
    w, wh, h = load_chunk(R32, QTYPE == Q6_K, q_ptr, hi_ptr, rows, nmask, c, stride_q, W)
    s0, s1 = _words(R32, sc_ptr, rows, nmask, stride_s, c, 1, 1)
    m0 = s0
    if QTYPE == Q4_K:
        m0, m1 = _words(R32, mn_ptr, rows, nmask, stride_s, c, 1, 1)
    tile = _tile16(QTYPE, w, h, s0, m0, dd, ddmin, W, INTERPRETED)
    cols = c * (8 * W) + tl.arange(0, 8 * W)  # x in the tile's order (prepare_x16)
    xs = tl.load(x_rows + cols[None, :], mask=mmask[:, None], other=0.0)
    a, b = xs, tl.trans(tile)
    if SWAP:  # acc [BLOCK_N, BLOCK_M]: the weight tile is the dot's first operand
        a, b = tile, tl.trans(xs)
    if INTERPRETED:  # its 16-bit dots multiply bit patterns: the same products in float32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gemm16_kernel(
    x_ptr,  # [M, K] fp16 activations, columns of each chunk in chunk_order's order
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,
    out_ptr,  # [M, N] (or [M, N / 2] with ACT), or [SPLITS, M, N] float32 partials (split-K)
    M, N, n_chunks, per_split, stride_xm, stride_om, stride_os, stride_q, stride_s, stride_d,
    QTYPE: tl.constexpr,  # Q4_K or Q6_K
    W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs; store act(gate) * up
    R32: tl.constexpr,  # row-interleaved planes (packed_rows)
    SWAP: tl.constexpr,  # the weight tile as the dot's first operand (accumulated transposed)
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows_m, rows, mmask, nmask, c0, c1 = gemm_tile(M, N, n_chunks, per_split, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + rows_m[:, None] * stride_xm
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dd, ddmin = _factors16(QTYPE, R32, d_ptr, dmin_ptr, rows, nmask, c0, stride_d)
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        c = c0
        while c < c1:
            nd, ndmin = _factors16(
                QTYPE, R32, d_ptr, dmin_ptr, rows, nmask & (c + 1 < c1), c + 1, stride_d
            )
            acc = _step16(
                acc, c, x_rows, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, dd, ddmin, rows, nmask,
                stride_q, stride_s, QTYPE, W, R32, SWAP, INTERPRETED,
            )  # fmt: skip
            dd, ddmin = nd, ndmin
            c += 1
    else:
        for c in range(c0, c1):
            nd, ndmin = _factors16(
                QTYPE, R32, d_ptr, dmin_ptr, rows, nmask & (c + 1 < c1), c + 1, stride_d
            )
            acc = _step16(
                acc, c, x_rows, mmask, q_ptr, hi_ptr, sc_ptr, mn_ptr, dd, ddmin, rows, nmask,
                stride_q, stride_s, QTYPE, W, R32, SWAP, INTERPRETED,
            )  # fmt: skip
            dd, ddmin = nd, ndmin
    if SWAP:
        acc = tl.trans(acc)
    store_tile(out_ptr, acc, rows_m, rows, M, N, stride_om, stride_os, BLOCK_M, BLOCK_N, ACT)


def chunk_order(k: int, words: int, device: torch.device) -> torch.Tensor:
    """Column of x for each column of the permuted activations: in every chunk of 8 * words
    elements, column 8 i + 2 j + h takes element words * (j + 4 h) + i (``_tile16``)."""
    p = torch.arange(8 * words, device=device)
    src = words * ((p // 2) % 4 + 4 * (p % 2)) + p // 8
    return (torch.arange(0, k, 8 * words, device=device)[:, None] + src[None, :]).reshape(-1)


@triton.jit
def _x16_kernel(x_ptr, out_ptr, stride_x, stride_o, W: tl.constexpr):
    """One chunk of one row: x's columns in ``chunk_order``'s order, clamped to fp16's range."""
    row = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * (8 * W)
    p = tl.arange(0, 8 * W)
    src = W * ((p // 2) % 4 + 4 * (p % 2)) + p // 8
    v = fp16_range(tl.load(x_ptr + row * stride_x + base + src).to(tl.float32))
    tl.store(out_ptr + row * stride_o + base + p, v.to(tl.float16))


def prepare_x16(x: torch.Tensor, words: int) -> torch.Tensor:
    """x [M, K] -> fp16 [M, K], clamped to fp16's range, every chunk's columns in the tile's
    order (``chunk_order``): one launch."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=torch.float16, device=x.device)
    if m:
        _x16_kernel[(m, k // (8 * words))](x, out, x.stride(0), out.stride(0), W=words, num_warps=1)
    return out


def launch_gemm16(x, pw: PackedWeight, out, cfg, interp, act: int = 0) -> None:
    """out = x @ unpack(pw).T ([M, N]) for a Q4_K or Q6_K weight, or with act the gated
    activation of its interleaved gate/up columns ([M, N / 2]). cfg: BLOCK_M, BLOCK_N,
    num_warps, num_stages, SPLIT_K (absent: split when the tiles leave SMs idle)."""
    if pw.qtype not in F16_TYPES:
        raise ValueError(f"gemm16: {GGMLQuantizationType(pw.qtype).name} has no fp16 path")
    xh = prepare_x16(x, WORDS[pw.qtype])

    def launch(grid, target, n_chunks, per_split, epilogue):
        _gemm16_kernel[grid](
            xh, *planes(pw), target, out.shape[0], pw.shape[0], n_chunks, per_split,
            xh.stride(0), target.stride(-2), out.shape[0] * pw.shape[0], *strides(pw),
            QTYPE=int(pw.qtype), W=WORDS[pw.qtype], BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"], ACT=epilogue, R32=pw.rows32,
            SWAP=bool(cfg.get("SWAP", 0)), INTERPRETED=interp,
            num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
        )  # fmt: skip

    launch_split(pw, out, cfg, act, launch)
