"""RoPE on q and k fused with the paged KV-cache write, in Triton.

One launch per layer replaces rope(q), rope(k) and the cache scatter. Angles are computed in
float32 from integer positions inside the kernel (no cos/sin cache to keep in sync): inv_freq[i]
= base^(-2i/rope_dim) [/ freq_factors[i]], theta = (position / scale) * inv_freq[i]. Layouts as in
shared/ops/rope.py: "norm" rotates pairs (2i, 2i+1), "neox" rotates (i, i + rope_dim/2); features
past rope_dim pass through. A float8_e4m3fn cache also gets a float32 scale per (token, kv head),
or uses fixed per-head scales: the conventions of shared/ops/paged_attention_fp8.py. Reference:
shared/ops/rope_kv.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shared.kernels.device import interpreted
from shared.kernels.gdc import launch_kw, launch_next, pdl, wait_prev
from shared.kernels.rounding import to_dtype
from shared.ops.paged_attention_fp8 import fixed_scales

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0
_CACHE_DTYPES = (*_FLOAT_DTYPES, _FP8_DTYPE)
# heads per program * padded head_dim: enough work per program without spilling registers
_TILE_ELEMENTS = 2048
# fewer heads a program until a launch has this many programs (or one head each): a decode step
# of one sequence ran 3 programs of 16 heads, 4.5 us a layer on the H200 (BENCHMARKS.md (ab))
_MIN_PROGRAMS = 64


@triton.jit
def rope_cos_sin(
    position,  # int64 scalar
    ff_ptr,  # [ROPE_DIM // 2] float32
    scale,
    exponent_step,  # -2 * log2(base) / rope_dim
    pairs,  # [BLOCK_PAIRS] pair index i
    pair_mask,
    HAS_FREQ_FACTORS: tl.constexpr,
):
    inv_freq = tl.exp2(pairs.to(tl.float32) * exponent_step)
    if HAS_FREQ_FACTORS:
        inv_freq = inv_freq / tl.load(ff_ptr + pairs, mask=pair_mask, other=1.0).to(tl.float32)
    theta = (position.to(tl.float32) / scale) * inv_freq
    return tl.cos(theta), tl.sin(theta)


@triton.jit
def _pair_columns(pairs, ROPE_DIM: tl.constexpr, NEOX: tl.constexpr):
    """Columns of the two features that pair i rotates together."""
    if NEOX:
        return pairs, pairs + ROPE_DIM // 2
    else:
        return 2 * pairs, 2 * pairs + 1


@triton.jit
def _rotate(
    src_ptr,  # base of this token's [heads, head_dim] rows
    rows,  # [BH, 1] row offsets (head * head stride)
    cols1,  # [1, BLOCK_PAIRS]
    cols2,  # [1, BLOCK_PAIRS]
    mask,  # [BH, BLOCK_PAIRS]
    cos,  # [1, BLOCK_PAIRS]
    sin,  # [1, BLOCK_PAIRS]
):
    x1 = tl.load(src_ptr + rows + cols1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + rows + cols2, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


@triton.jit
def _abs_max_rows(x):
    return tl.max(tl.abs(x), axis=1)


@triton.jit
def _fp8_scaled(x, scale, FP8_MAX: tl.constexpr):
    """x / scale clamped to e4m3's finite range (rounding can leave amax / scale a hair over)."""
    return tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [T, n_heads, HEAD_DIM], last dim contiguous
    k_ptr,  # [T, n_kv_heads, HEAD_DIM], last dim contiguous
    v_ptr,  # [T, n_kv_heads, HEAD_DIM], last dim contiguous
    q_out_ptr,  # [T, n_heads, HEAD_DIM] contiguous
    positions_ptr,  # [T] int64
    slot_mapping_ptr,  # [T] int64: block * block_size + offset, < 0 = skip
    k_cache_ptr,  # [num_blocks, block_size, n_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, block_size, n_kv_heads, HEAD_DIM], k_cache's strides
    k_scale_ptr,  # [num_blocks, block_size, n_kv_heads] float32, FP8 only
    v_scale_ptr,  # [num_blocks, block_size, n_kv_heads] float32, k_scale's strides
    ff_ptr,  # [ROPE_DIM // 2] float32, HAS_FREQ_FACTORS only
    stride_qt,  # int64
    stride_qh,  # int64
    stride_kt,  # int64
    stride_kh,  # int64
    stride_vt,  # int64
    stride_vh,  # int64
    stride_cache_b,  # int64
    stride_cache_o,  # int64
    stride_cache_h,  # int64
    stride_scale_b,  # int64
    stride_scale_o,  # int64
    stride_scale_h,  # int64
    n_heads,
    n_kv_heads,
    block_size,
    scale,
    exponent_step,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    NEOX: tl.constexpr,
    HAS_FREQ_FACTORS: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FIXED_SCALES: tl.constexpr,  # FP8 with one scale per KV head (block and slot strides 0)
    BH: tl.constexpr,  # heads per program
    BLOCK_PAIRS: tl.constexpr,  # >= ROPE_DIM // 2
    BLOCK_PASS: tl.constexpr,  # >= HEAD_DIM - ROPE_DIM
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM
    PDL: tl.constexpr,  # launched early (shared.kernels.gdc)
    INTERPRETED: tl.constexpr,  # bf16 rounded to nearest by hand (shared.kernels.rounding)
):
    # grid: (T, q head groups + kv head groups); a program rotates BH q heads, or rotates BH
    # k heads and stores them with their v heads.
    launch_next(PDL)
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    n_q_groups = tl.cdiv(n_heads, BH)

    # the angles while the previous kernel ends: positions (and slots) are the step's inputs,
    # copied before its first kernel, which is no early launch (gdc), so they are written by now
    pairs = tl.arange(0, BLOCK_PAIRS)
    pair_mask = pairs < ROPE_DIM // 2
    position = tl.load(positions_ptr + t)
    cos, sin = rope_cos_sin(
        position, ff_ptr, scale, exponent_step, pairs, pair_mask, HAS_FREQ_FACTORS
    )
    wait_prev(PDL)
    cos, sin = cos[None, :], sin[None, :]
    c1, c2 = _pair_columns(pairs, ROPE_DIM, NEOX)
    c1, c2 = c1[None, :], c2[None, :]
    pass_cols = ROPE_DIM + tl.arange(0, BLOCK_PASS)[None, :]

    if group < n_q_groups:
        heads = (group * BH + tl.arange(0, BH))[:, None]
        head_mask = heads < n_heads
        mask = head_mask & pair_mask[None, :]
        src = q_ptr + t * stride_qt
        o1, o2 = _rotate(src, heads * stride_qh, c1, c2, mask, cos, sin)
        dst = q_out_ptr + (t * n_heads + heads) * HEAD_DIM
        tl.store(dst + c1, to_dtype(o1, q_out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        tl.store(dst + c2, to_dtype(o2, q_out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
        if ROPE_DIM < HEAD_DIM:
            pmask = head_mask & (pass_cols < HEAD_DIM)
            rest = tl.load(src + heads * stride_qh + pass_cols, mask=pmask)
            tl.store(dst + pass_cols, rest, mask=pmask)
    else:
        slot = tl.load(slot_mapping_ptr + t)
        if slot >= 0:
            head_ids = (group - n_q_groups) * BH + tl.arange(0, BH)
            heads = head_ids[:, None]
            head_mask = heads < n_kv_heads
            mask = head_mask & pair_mask[None, :]
            block = slot // block_size
            offset = slot % block_size
            cache_row = block * stride_cache_b + offset * stride_cache_o + heads * stride_cache_h
            src = k_ptr + t * stride_kt
            o1, o2 = _rotate(src, heads * stride_kh, c1, c2, mask, cos, sin)
            # rounded to k's dtype first, as the reference rotates k and then writes it
            o1 = to_dtype(o1, k_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
            o2 = to_dtype(o2, k_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
            pmask = head_mask & (pass_cols < HEAD_DIM)
            rest = tl.zeros((BH, BLOCK_PASS), dtype=tl.float32)
            if ROPE_DIM < HEAD_DIM:
                rest = tl.load(src + heads * stride_kh + pass_cols, mask=pmask, other=0.0)
                rest = rest.to(tl.float32)
            d = tl.arange(0, BLOCK_D)[None, :]
            vmask = head_mask & (d < HEAD_DIM)
            vals = tl.load(v_ptr + t * stride_vt + heads * stride_vh + d, mask=vmask, other=0.0)
            vals = vals.to(tl.float32)
            if FP8:
                scale_row = block * stride_scale_b + offset * stride_scale_o
                scale_row += head_ids * stride_scale_h
                smask = head_ids < n_kv_heads
                if FIXED_SCALES:  # one calibrated scale per KV head, read and never written
                    k_scale = tl.load(k_scale_ptr + scale_row, mask=smask, other=1.0)
                    v_scale = tl.load(v_scale_ptr + scale_row, mask=smask, other=1.0)
                else:
                    k_amax = tl.maximum(_abs_max_rows(o1), _abs_max_rows(o2))
                    k_amax = tl.maximum(k_amax, _abs_max_rows(rest))
                    v_amax = _abs_max_rows(vals)
                    k_scale, v_scale = k_amax / FP8_MAX, v_amax / FP8_MAX
                    # an all-zero head (or a scale that underflows) stores zeros with scale 1
                    k_scale = tl.where(k_scale > 0, k_scale, 1.0)
                    v_scale = tl.where(v_scale > 0, v_scale, 1.0)
                    tl.store(k_scale_ptr + scale_row, k_scale, mask=smask)
                    tl.store(v_scale_ptr + scale_row, v_scale, mask=smask)
                o1 = _fp8_scaled(o1, k_scale, FP8_MAX)
                o2 = _fp8_scaled(o2, k_scale, FP8_MAX)
                rest = _fp8_scaled(rest, k_scale, FP8_MAX)
                vals = _fp8_scaled(vals, v_scale, FP8_MAX)
            k_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + cache_row + c1, to_dtype(o1, k_dtype, INTERPRETED), mask=mask)
            tl.store(k_cache_ptr + cache_row + c2, to_dtype(o2, k_dtype, INTERPRETED), mask=mask)
            if ROPE_DIM < HEAD_DIM:
                rest = to_dtype(rest, k_dtype, INTERPRETED)
                tl.store(k_cache_ptr + cache_row + pass_cols, rest, mask=pmask)
            v_dtype = v_cache_ptr.dtype.element_ty
            tl.store(v_cache_ptr + cache_row + d, to_dtype(vals, v_dtype, INTERPRETED), mask=vmask)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_dim: int,
    base: float,
    scale: float,
    freq_factors: torch.Tensor | None,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
) -> None:
    def fail(msg: str) -> None:
        raise ValueError(f"rope_and_write_kv: {msg}")

    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        fail(f"q, k, v must be 3-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n_tokens, _, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != n_tokens or k.shape[2] != head_dim:
        fail(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must be "
            f"[{n_tokens}, n_kv_heads, {head_dim}]"
        )
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        fail(
            "q, k, v must share one of float32/float16/bfloat16, "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        fail("q, k and v need a contiguous last dim")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dtype != torch.int64 or t.shape != (n_tokens,) or not t.is_contiguous():
            fail(f"{name} must be contiguous int64 [{n_tokens}], got {t.dtype} {tuple(t.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        fail(f"k_cache {tuple(k_cache.shape)} must be [num_blocks, block_size, *{k.shape[1:]}]")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        fail("v_cache must have k_cache's shape and strides")
    if k_cache.dtype not in _CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        fail(
            "caches must share a float or float8_e4m3fn dtype, "
            f"got {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1:
        fail("the caches need a contiguous last dim")
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        fail(f"rope_dim {rope_dim} must be even and in (0, head_dim={head_dim}]")
    if not (base > 0 and scale > 0):
        fail(f"base {base} and scale {scale} must be positive")
    if freq_factors is not None and (
        freq_factors.shape != (rope_dim // 2,)
        or freq_factors.dtype not in _FLOAT_DTYPES
        or not freq_factors.is_contiguous()
    ):
        fail(f"freq_factors must be a contiguous float [{rope_dim // 2}] vector")
    if k_cache.dtype == _FP8_DTYPE:
        if k_scale_cache is None or v_scale_cache is None:
            fail("a float8_e4m3fn cache needs k_scale_cache and v_scale_cache")
        if k_scale_cache.shape != k_cache.shape[:3] or k_scale_cache.dtype != torch.float32:
            fail(f"k_scale_cache must be float32 {tuple(k_cache.shape[:3])}")
        if v_scale_cache.shape != k_scale_cache.shape or v_scale_cache.dtype != torch.float32:
            fail(f"v_scale_cache must be float32 {tuple(k_cache.shape[:3])}")
        if v_scale_cache.stride() != k_scale_cache.stride():
            fail("v_scale_cache must have k_scale_cache's strides")
    elif k_scale_cache is not None or v_scale_cache is not None:
        fail(f"scale caches are for a float8_e4m3fn cache, not {k_cache.dtype}")
    tensors = [q, k, v, positions, slot_mapping, k_cache, v_cache, freq_factors]
    tensors += [k_scale_cache, v_scale_cache]
    if any(t is not None and t.device != q.device for t in tensors):
        fail("all tensors must be on one device")


def rope_and_write_kv(
    q: torch.Tensor,  # [T, n_heads, head_dim]
    k: torch.Tensor,  # [T, n_kv_heads, head_dim]
    v: torch.Tensor,  # [T, n_kv_heads, head_dim]
    positions: torch.Tensor,  # [T] int64
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64: block * block_size + offset, < 0 to skip
    rope_dim: int,
    base: float,
    neox: bool,
    scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,  # [rope_dim // 2]
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, n_kv_heads] float32
    v_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, n_kv_heads] float32
) -> torch.Tensor:
    """Rotates q and k, writes rotated k and v into the caches at slot_mapping (in the caches'
    dtype), and returns rotated q as a new contiguous tensor; q, k and v are not modified.

    q, k, v may be strided views (of a fused QKV output) with a contiguous last dim. Slots must
    lie in the cache (not checked: that would synchronize with the device); negative slots are
    skipped. For a float8_e4m3fn cache, k_scale_cache/v_scale_cache receive amax / 448 per
    (token, kv head) and the cache x / scale; scale caches with block and slot strides 0 hold one
    fixed scale per KV head (shared/ops/paged_attention_fp8.py), which the write only reads.
    """
    _check_inputs(
        q, k, v, positions, k_cache, v_cache, slot_mapping, rope_dim, base, scale,
        freq_factors, k_scale_cache, v_scale_cache,
    )  # fmt: skip
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n_tokens == 0:
        return q_out
    fp8 = k_cache.dtype == _FP8_DTYPE
    block_d = triton.next_power_of_2(head_dim)
    bh = min(triton.next_power_of_2(max(n_heads, n_kv_heads)), max(1, _TILE_ELEMENTS // block_d))
    n_groups = triton.cdiv(n_heads, bh) + triton.cdiv(n_kv_heads, bh)
    while bh > 1 and n_tokens * n_groups < _MIN_PROGRAMS:
        bh //= 2
        n_groups = triton.cdiv(n_heads, bh) + triton.cdiv(n_kv_heads, bh)
    scale_strides = k_scale_cache.stride() if fp8 else (0, 0, 0)
    early = pdl(q.device, _rope_write_kv_kernel)
    _rope_write_kv_kernel[(n_tokens, n_groups)](
        q, k, v, q_out, positions, slot_mapping, k_cache, v_cache,
        k_scale_cache if fp8 else k_cache, v_scale_cache if fp8 else v_cache,
        freq_factors if freq_factors is not None else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        n_heads, n_kv_heads, k_cache.shape[1], float(scale), -2.0 * math.log2(base) / rope_dim,
        HEAD_DIM=head_dim, ROPE_DIM=rope_dim, NEOX=bool(neox),
        HAS_FREQ_FACTORS=freq_factors is not None, FP8=fp8, FP8_MAX=_FP8_MAX,
        FIXED_SCALES=fp8 and fixed_scales(k_scale_cache),
        BH=bh, BLOCK_PAIRS=triton.next_power_of_2(rope_dim // 2),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - rope_dim, 1)), BLOCK_D=block_d,
        PDL=early, INTERPRETED=interpreted(_rope_write_kv_kernel), num_warps=4,
        **launch_kw(early),
    )  # fmt: skip
    return q_out
