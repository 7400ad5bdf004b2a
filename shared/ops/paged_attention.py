"""Attention over a paged KV cache: the torch reference used on the CPU and by kernel tests.

Each sequence's new queries are the last `n_query` positions of its `seq_len` keys (a cached prefix
followed by this step's tokens), so prefill, chunked prefill and decode are one code path.
"""

from __future__ import annotations

import torch


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    k: torch.Tensor,  # [T, n_kv_heads, head_dim]
    v: torch.Tensor,  # [T, n_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64: block * block_size + offset
) -> None:
    kv_shape = (-1,) + tuple(k_cache.shape[2:])
    k_cache.view(kv_shape)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(kv_shape)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [T, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: list[int],  # B + 1 offsets into the T query rows
    seq_lens: list[int],  # B: keys per sequence, this step's included
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // n_kv_heads
    out = torch.empty_like(q)
    for b, n_keys in enumerate(seq_lens):
        q0, q1 = query_start_loc[b], query_start_loc[b + 1]
        n_query = q1 - q0
        if n_query == 0:
            continue
        n_blocks = -(-n_keys // block_size)
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, n_kv_heads, k_cache.shape[-1])[:n_keys].float()
        v = v_cache[blocks].reshape(-1, n_kv_heads, v_cache.shape[-1])[:n_keys].float()
        k = k.repeat_interleave(group, dim=1)  # [n_keys, n_heads, D]
        v = v.repeat_interleave(group, dim=1)
        # operands are rounded to the cache dtype, as a tensor-core kernel over this cache does
        qb = q[q0:q1].to(k_cache.dtype).float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(n_keys - n_query, n_keys, device=q.device)[:, None]
        k_pos = torch.arange(n_keys, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v_cache.dtype).float()
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
