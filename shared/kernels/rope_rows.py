"""RoPE on rows a kernel has loaded whole, for decode attention with the step's RoPE and KV
write folded in (``paged_attention(..., rope_kv=RopeKV(...))``).

A [ROWS, D] tile of heads (D = rope_dim, a power of two) is split into its rotated pairs in
registers: "norm" pairs (2i, 2i+1) by a reshape to [ROWS, D/2, 2], "neox" pairs (i, i + D/2) by
a reshape to [ROWS, 2, D/2] and a transpose, so each pair's two values come from the one load.
The rotation and the angles are ``shared.kernels.rope_kv``'s: o1 = x1 cos - x2 sin, o2 = x1 sin
+ x2 cos with theta = (position / scale) * base^(-2i/D) [/ freq_factors[i]], computed for the
D/2 pairs once a program.
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
    (attention's own argument) is raw too; positions and slot_mapping as ``rope_and_write_kv``'s.
    Only whole-head rotations of a power-of-two head_dim (``foldable``)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, < 0: not written
    rope_dim: int
    base: float
    neox: bool
    scale: float = 1.0
    freq_factors: torch.Tensor | None = None  # [rope_dim // 2]

    @staticmethod
    def foldable(rope_dim: int, head_dim: int) -> bool:
        """Whether attention can rotate these heads itself: the whole head, a power of two."""
        return rope_dim == head_dim and head_dim >= 16 and head_dim & (head_dim - 1) == 0

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
        if not self.foldable(self.rope_dim, head_dim):
            return f"rope_dim {self.rope_dim} must be head_dim {head_dim}, a power of two"
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
def pair_angles(
    position, ff_ptr, scale, exponent_step, D: tl.constexpr, HAS_FREQ_FACTORS: tl.constexpr
):
    """cos and sin [D / 2] of each rotated pair at `position` (an int64 scalar)."""
    pairs = tl.arange(0, D // 2)
    return _rope_cos_sin(position, ff_ptr, scale, exponent_step, pairs, pairs < D // 2,
                         HAS_FREQ_FACTORS)  # fmt: skip


@triton.jit
def rotate_rows(x, cos, sin, ROWS: tl.constexpr, D: tl.constexpr, NEOX: tl.constexpr):
    """x [ROWS, D] rotated by the pairs' cos and sin [D / 2], in float32."""
    x = x.to(tl.float32)
    if NEOX:
        x1, x2 = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, D // 2)), (0, 2, 1)))
    else:
        x1, x2 = tl.split(tl.reshape(x, (ROWS, D // 2, 2)))
    c, s = cos[None, :], sin[None, :]
    o1 = x1 * c - x2 * s
    o2 = x1 * s + x2 * c
    if NEOX:
        return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (ROWS, D))
    return tl.reshape(tl.join(o1, o2), (ROWS, D))
