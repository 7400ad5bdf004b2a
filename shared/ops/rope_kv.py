"""RoPE on q and k, then k and v written into the paged KV cache: the torch reference for
shared/kernels/rope_kv.rope_and_write_kv.

A float8_e4m3fn cache follows shared/ops/paged_attention_fp8.py: one float32 scale per (token, kv
head), amax over head_dim / 448 (1 for an all-zero head), value x / scale, so x ≈ fp8 * scale; or
one fixed scale per KV head, read and not written.
Slots below zero (padding tokens) are not written.
"""

from __future__ import annotations

import torch

from shared.ops.paged_attention import write_kv
from shared.ops.paged_attention_fp8 import FP8, write_kv_fp8
from shared.ops.rope import apply_rope, rope_angles


def rope_and_write_kv_ref(
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
    freq_factors: torch.Tensor | None = None,
    k_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, n_kv_heads] float32
    v_scale_cache: torch.Tensor | None = None,  # [num_blocks, block_size, n_kv_heads] float32
) -> torch.Tensor:
    """Writes the caches in place and returns rotated q as a new tensor."""
    cos, sin = rope_angles(positions, rope_dim, base, scale, freq_factors)
    q_rot = apply_rope(q, cos, sin, neox)
    k_rot = apply_rope(k, cos, sin, neox)
    keep = slot_mapping >= 0
    slots, k_rot, v = slot_mapping[keep], k_rot[keep], v[keep]
    if k_cache.dtype == FP8:
        if k_scale_cache is None or v_scale_cache is None:
            raise ValueError("an fp8 KV cache needs k_scale_cache and v_scale_cache")
        write_kv_fp8(k_cache, v_cache, k_scale_cache, v_scale_cache, k_rot, v, slots)
    else:
        write_kv(k_cache, v_cache, k_rot, v, slots)
    return q_rot
