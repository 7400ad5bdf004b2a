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
    """Chunks of up to ROW_WISE_QUERIES queries are computed a query at a time, each exactly as
    a decode step computes it (one query over its keys): a speculative step's draft rows then
    give the very logits plain decoding gives (greedy output unchanged, bit for bit); a longer
    chunk (a prompt) in one matmul a KV head."""
    out = torch.empty_like(q)
    for b, n_keys in enumerate(seq_lens):
        q0, q1 = query_start_loc[b], query_start_loc[b + 1]
        n_query = q1 - q0
        if n_query == 0:
            continue
        table = block_tables[b]
        if n_query <= ROW_WISE_QUERIES:
            for j in range(n_query):
                keys = n_keys - n_query + 1 + j
                out[q0 + j] = _attend(q[q0 + j : q0 + j + 1], k_cache, v_cache, table, keys,
                                      scale, sliding_window)[0]  # fmt: skip
        else:
            out[q0:q1] = _attend(q[q0:q1], k_cache, v_cache, table, n_keys, scale, sliding_window)
    return out


# the longest draft a step verifies (16), and the token before it: see paged_attention_ref
ROW_WISE_QUERIES = 17


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    n_keys: int,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """One sequence's queries q [n_query, n_heads, D], the last n_query of its n_keys keys."""
    block_size, n_kv_heads, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n_query, group = q.shape[0], q.shape[1] // n_kv_heads
    # keys before the first query's window are no query's: their blocks are not read
    first = max(0, n_keys - n_query - sliding_window + 1) if sliding_window else 0
    b0 = first // block_size
    rows = _key_rows(table, b0, n_keys, block_size)
    window = slice(first - b0 * block_size, n_keys - b0 * block_size)
    k = _gather(k_cache, rows)[window].float()
    v = _gather(v_cache, rows)[window].float()
    # operands are rounded to the cache dtype, as a tensor-core kernel over this cache does.
    # A KV head's query heads (g) and rows side by side: [kv heads, g * n_query, D] against
    # its keys [kv heads, D, keys], so the keys are not repeated per query head
    qb = q.to(k_cache.dtype).float().reshape(n_query, n_kv_heads, group, dim)
    qb = qb.permute(1, 2, 0, 3).reshape(n_kv_heads, group * n_query, dim)
    scores = torch.matmul(qb, k.permute(1, 2, 0)).mul_(scale)
    if n_query > 1 or (sliding_window and n_keys - first > sliding_window):
        q_pos = torch.arange(n_keys - n_query, n_keys, device=q.device)[:, None]
        k_pos = torch.arange(first, n_keys, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed &= q_pos - k_pos < sliding_window
        scores = scores.view(n_kv_heads, group, n_query, -1).masked_fill(~allowed, -torch.inf)
        scores = scores.view(n_kv_heads, group * n_query, -1)
    probs = torch.softmax(scores, dim=-1).to(v_cache.dtype).float()
    o = torch.matmul(probs, v.transpose(0, 1)).view(n_kv_heads, group, n_query, dim)
    return o.permute(2, 0, 1, 3).reshape(n_query, -1, dim).to(q.dtype)


def _key_rows(table: torch.Tensor, b0: int, n_keys: int, block_size: int) -> slice | torch.Tensor:
    """Where one sequence's keys from block b0 of its table to key n_keys lie in the pool's
    [blocks * block_size] rows: a slice where those blocks are consecutive (a sequence
    allocated in one go), else the blocks to gather (an index for K and V alike)."""
    blocks = table[b0 : -(-n_keys // block_size)]
    start, n = int(blocks[0]), n_keys - b0 * block_size
    if start + len(blocks) - 1 == int(blocks[-1]) and bool((blocks.diff() == 1).all()):
        return slice(start * block_size, start * block_size + n)
    return blocks.long()


def _gather(cache: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """One sequence's keys (or values), [keys, n_kv_heads, head_dim]: a view for a slice, else
    a copy of whole blocks (the caller cuts the keys it reads)."""
    if isinstance(rows, slice):
        return cache.view(-1, *cache.shape[2:])[rows]
    return cache.index_select(0, rows).view(-1, *cache.shape[2:])
