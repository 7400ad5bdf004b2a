"""FP8 (e4m3) KV cache: the write path and the attention reference.

A cached value is fp8 * scale. Scales come one of two ways:
- per token and KV head (the default), chosen on write so the token's largest magnitude maps to
  448, e4m3's largest finite value;
- per KV head of a layer, fixed (calibrated when the engine starts, shared.kv.calibrate): the
  scale tensor is then a [n_kv_heads] vector expanded to [num_blocks, block_size, n_kv_heads]
  (block and slot strides 0), a write divides by it and clamps to ±448, and no scale is stored.
Attention over such a cache computes in
q's dtype, rounding like the Triton kernel: FP8 values are exact in fp16/bf16, so K's scale
multiplies the float32 scores (K is never rounded), while V is dequantized and rounded to q's
dtype, as are the probabilities.
"""

from __future__ import annotations

import torch

from shared.ops.paged_attention import paged_attention_ref

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_kv_fp8(
    x: torch.Tensor,  # [T, n_kv_heads, head_dim]
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (fp8 values [T, n_kv_heads, head_dim], scales [T, n_kv_heads] in scale_dtype)."""
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).to(scale_dtype)
    # an all-zero row (or one whose scale underflows scale_dtype) quantizes to zeros with scale 1
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def fixed_scales(scales: torch.Tensor) -> bool:
    """True for a scale cache that holds one scale per KV head (block and slot strides 0)."""
    return scales.stride(0) == 0 and scales.stride(1) == 0


def write_kv_fp8(
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim] float8_e4m3fn
    v_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim] float8_e4m3fn
    k_scale: torch.Tensor,  # [num_blocks, block_size, n_kv_heads]
    v_scale: torch.Tensor,  # [num_blocks, block_size, n_kv_heads]
    k: torch.Tensor,  # [T, n_kv_heads, head_dim]
    v: torch.Tensor,  # [T, n_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64: block * block_size + offset
) -> None:
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        rows = cache.view((-1,) + tuple(cache.shape[2:]))
        if fixed_scales(scales):
            per_head = scales[0, 0].float()[None, :, None]
            rows[slot_mapping] = (x.float() / per_head).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            continue
        values, s = quantize_kv_fp8(x, scales.dtype)
        rows[slot_mapping] = values
        scales.view((-1,) + tuple(scales.shape[2:]))[slot_mapping] = s


def dequantize_kv_fp8(
    cache: torch.Tensor,  # [..., head_dim] float8_e4m3fn
    scales: torch.Tensor,  # [...]
    dtype: torch.dtype,
) -> torch.Tensor:
    return (cache.float() * scales.float()[..., None]).to(dtype)


def paged_attention_fp8_ref(
    q: torch.Tensor,  # [T, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim] float8_e4m3fn
    v_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim] float8_e4m3fn
    k_scale: torch.Tensor,  # [num_blocks, block_size, n_kv_heads]
    v_scale: torch.Tensor,  # [num_blocks, block_size, n_kv_heads]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: list[int],  # B + 1 offsets into the T query rows
    seq_lens: list[int],  # B: keys per sequence, this step's included
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    # Dequantize only the blocks the batch reads, into a compact cache with remapped tables.
    block_size = k_cache.shape[1]
    tables = torch.zeros_like(block_tables)
    used: list[torch.Tensor] = []
    n_used = 0
    for b, n_keys in enumerate(seq_lens):
        blocks = block_tables[b, : -(-n_keys // block_size)].long()
        used.append(blocks)
        tables[b, : blocks.numel()] = torch.arange(
            n_used, n_used + blocks.numel(), dtype=tables.dtype, device=tables.device
        )
        n_used += blocks.numel()
    if n_used == 0:
        return torch.zeros_like(q)
    blocks = torch.cat(used)
    k = dequantize_kv_fp8(k_cache[blocks], k_scale[blocks], torch.float32)
    v = dequantize_kv_fp8(v_cache[blocks], v_scale[blocks], q.dtype)
    return paged_attention_ref(q, k, v, tables, query_start_loc, seq_lens, scale, sliding_window)
