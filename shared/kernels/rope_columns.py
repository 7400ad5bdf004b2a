"""RoPE by column, for kernels that rotate a head they have loaded whole (decode attention with
the step's RoPE and KV write folded in, ``paged_attention(..., rope_kv=...)``).

Column d of a head is rotated with its partner column: rotated[d] = x[d] * cos + x[partner] *
signed_sin, where the pair's first column takes -sin and its second +sin. That is
``shared.kernels.rope_kv``'s o1 = x1 cos - x2 sin, o2 = x1 sin + x2 cos, with the same angles
(``_rope_cos_sin``); columns past rope_dim pass through (cos 1, sin 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.kernels.rope_kv import _rope_cos_sin


@dataclass(frozen=True)
class RopeKV:
    """The step's RoPE and KV write, for ``paged_attention`` to do in its programs: k and v are
    the step's raw rows ([T, n_kv_heads, head_dim], views of a fused QKV output allowed), q
    (attention's own argument) is raw too; positions and slot_mapping as ``rope_and_write_kv``'s."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, < 0: not written
    rope_dim: int
    base: float
    neox: bool
    scale: float = 1.0
    freq_factors: torch.Tensor | None = None  # [rope_dim // 2]

    def check(self, q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
        """What is wrong with these for q and a 16-bit cache, or None."""
        n_tokens, _, head_dim = q.shape
        shape = (n_tokens, k_cache.shape[2], head_dim)
        if tuple(self.k.shape) != shape or tuple(self.v.shape) != shape:
            return f"rope_kv k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must be {shape}"
        if self.k.dtype != q.dtype or self.v.dtype != q.dtype:
            return f"rope_kv k/v dtypes {self.k.dtype}/{self.v.dtype} must be q's {q.dtype}"
        if self.k.stride(-1) != 1 or self.v.stride(-1) != 1:
            return "rope_kv k and v need a contiguous last dim"
        for name, t in (("positions", self.positions), ("slot_mapping", self.slot_mapping)):
            if t.dtype != torch.int64 or t.shape != (n_tokens,) or not t.is_contiguous():
                return f"rope_kv {name} must be contiguous int64 [{n_tokens}]"
        if self.rope_dim <= 0 or self.rope_dim % 2 or self.rope_dim > head_dim:
            return f"rope_dim {self.rope_dim} must be even and in (0, {head_dim}]"
        if not (self.base > 0 and self.scale > 0):
            return f"rope base {self.base} and scale {self.scale} must be positive"
        ff = self.freq_factors
        if ff is not None and (ff.shape != (self.rope_dim // 2,) or not ff.is_contiguous()):
            return f"freq_factors must be a contiguous [{self.rope_dim // 2}] vector"
        tensors = (self.k, self.v, self.positions, self.slot_mapping, ff)
        if any(t is not None and t.device != q.device for t in tensors):
            return "rope_kv tensors must be on q's device"
        return None

    def exponent_step(self) -> float:
        """-2 log2(base) / rope_dim: inv_freq[i] = exp2(i * this), as ``rope_and_write_kv``."""
        return -2.0 * math.log2(self.base) / self.rope_dim


@triton.jit
def rope_columns(
    position,  # int64 scalar
    ff_ptr,
    scale,
    exponent_step,
    d,  # [BLOCK_D] columns
    ROPE_DIM: tl.constexpr,
    NEOX: tl.constexpr,
    HAS_FREQ_FACTORS: tl.constexpr,
):
    """(partner column, cos, signed sin) of each column d; partner = d past rope_dim."""
    rotated = d < ROPE_DIM
    if NEOX:
        first = d < ROPE_DIM // 2
        pair = tl.where(first, d, d - ROPE_DIM // 2)
        partner = tl.where(first, d + ROPE_DIM // 2, d - ROPE_DIM // 2)
    else:
        first = d % 2 == 0
        pair = d // 2
        partner = d ^ 1
    pair = tl.where(rotated, pair, 0)
    cos, sin = _rope_cos_sin(
        position, ff_ptr, scale, exponent_step, pair, rotated, HAS_FREQ_FACTORS
    )
    cos = tl.where(rotated, cos, 1.0)
    signed_sin = tl.where(rotated, tl.where(first, -sin, sin), 0.0)
    return tl.where(rotated, partner, d), cos, signed_sin


@triton.jit
def rotate_loaded(x, x_partner, cos, signed_sin):
    """float32 rotation of loaded columns (x[d], x[partner(d)]) by ``rope_columns``' factors."""
    return x.to(tl.float32) * cos + x_partner.to(tl.float32) * signed_sin
