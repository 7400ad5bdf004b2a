"""Attention over a paged KV cache: the torch reference used on the CPU and by kernel tests.

Each sequence's new queries are the last `n_query` positions of its `seq_len` keys (a cached prefix
followed by this step's tokens), so prefill, chunked prefill and decode are one code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    a decode step computes it (one query over its keys, the same values at the same strides):
    a speculative step's draft rows then give the very logits plain decoding gives (greedy
    output unchanged, bit for bit); a longer chunk (a prompt) in one matmul a KV head. A
    sequence's keys are gathered once, whatever the number of its queries."""
    out = torch.empty_like(q)
    w = sliding_window
    dtypes = (k_cache.dtype, v_cache.dtype)
    for b, n_keys in enumerate(seq_lens):
        q0, q1 = query_start_loc[b], query_start_loc[b + 1]
        n_query = q1 - q0
        if n_query == 0:
            continue
        # keys before the first query's window are no query's: their blocks are not read
        first = max(0, n_keys - n_query - w + 1) if w else 0
        k, v = _keys(k_cache, v_cache, block_tables[b], first, n_keys)
        if n_query > ROW_WISE_QUERIES:
            out[q0:q1] = _attend(q[q0:q1], k, v, n_keys, first, scale, w, dtypes)
            continue
        for j in range(n_query):
            keys = n_keys - n_query + 1 + j
            start = max(0, keys - w) if w else 0  # as a decode step's first key
            kj, vj = k[start - first : keys - first], v[start - first : keys - first]
            out[q0 + j] = _attend(q[q0 + j : q0 + j + 1], kj, vj, keys, start, scale, w,
                                  dtypes)[0]  # fmt: skip
    return out


# the longest draft a step verifies (16), and the token before it: see paged_attention_ref
ROW_WISE_QUERIES = 17


def _keys(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, first: int, n_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values first..n_keys, [keys, n_kv_heads, head_dim] in float32."""
    block_size = k_cache.shape[1]
    b0 = first // block_size
    rows = _key_rows(table, b0, n_keys, block_size)
    window = slice(first - b0 * block_size, n_keys - b0 * block_size)
    return _gather(k_cache, rows)[window].float(), _gather(v_cache, rows)[window].float()


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n_keys: int,
    first: int,
    scale: float,
    sliding_window: int,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> torch.Tensor:
    """One sequence's queries q [n_query, n_heads, D], the last n_query of its n_keys keys,
    over its keys and values first..n_keys (k, v: [n_keys - first, n_kv_heads, D], float32),
    read from caches of dtypes (K's, V's)."""
    n_kv_heads, dim = k.shape[1], k.shape[2]
    n_query, group = q.shape[0], q.shape[1] // n_kv_heads
    masked = n_query > 1 or (sliding_window and n_keys - first > sliding_window)
    if q.dtype == dtypes[0] == dtypes[1] == torch.float32:
        # nothing to round: torch's fused attention, which never holds the scores of every
        # head (2 cores, 32 queries over 6,000 keys: 7.7 ms a layer against 12.4 unfused;
        # a 512-token chunk over 3,000: 35 against 142)
        mask = _allowed(n_query, n_keys, first, sliding_window, q.device) if masked else None
        o = F.scaled_dot_product_attention(
            q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None],
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # fmt: skip
        return o[0].permute(1, 0, 2).to(q.dtype)
    # operands are rounded to the cache dtype, as a tensor-core kernel over this cache does.
    # A KV head's query heads (g) and rows side by side: [kv heads, g * n_query, D] against
    # its keys [kv heads, D, keys], so the keys are not repeated per query head
    qb = q.to(dtypes[0]).float().reshape(n_query, n_kv_heads, group, dim)
    qb = qb.permute(1, 2, 0, 3).reshape(n_kv_heads, group * n_query, dim)
    scores = torch.matmul(qb, k.permute(1, 2, 0)).mul_(scale)
    if masked:
        allowed = _allowed(n_query, n_keys, first, sliding_window, q.device)
        scores = scores.view(n_kv_heads, group, n_query, -1).masked_fill(~allowed, -torch.inf)
        scores = scores.view(n_kv_heads, group * n_query, -1)
    probs = torch.softmax(scores, dim=-1).to(dtypes[1]).float()
    o = torch.matmul(probs, v.transpose(0, 1)).view(n_kv_heads, group, n_query, dim)
    return o.permute(2, 0, 1, 3).reshape(n_query, -1, dim).to(q.dtype)


def _allowed(
    n_query: int, n_keys: int, first: int, sliding_window: int, device: torch.device
) -> torch.Tensor:
    """[n_query, n_keys - first] bool: which keys each of the last n_query queries sees."""
    q_pos = torch.arange(n_keys - n_query, n_keys, device=device)[:, None]
    k_pos = torch.arange(first, n_keys, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window:
        allowed &= q_pos - k_pos < sliding_window
    return allowed


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
