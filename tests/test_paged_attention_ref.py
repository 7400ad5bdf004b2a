"""The torch paged attention (the CPU worker's, and the kernels' reference) against a dense
attention over the whole context with every query head's keys repeated: GQA groups, causal
chunks after a cached prefix, sliding windows, blocks scattered in the pool."""

from __future__ import annotations

import pytest
import torch

from shared.ops.paged_attention import paged_attention_ref, write_kv


def _dense(q, k, v, n_keys, scale, window):
    """q [n_query, H, D] the last positions of n_keys keys [n_keys, KVH, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(n_keys - q.shape[0], n_keys)[:, None]
    k_pos = torch.arange(n_keys)[None, :]
    allowed = k_pos <= q_pos
    if window:
        allowed &= q_pos - k_pos < window
    probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("scattered", [True, False])  # blocks out of order, or consecutive
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])
def test_matches_dense_attention(heads: tuple[int, int], window: int, scattered: bool) -> None:
    n_heads, n_kv = heads
    g = torch.Generator().manual_seed(window + n_heads)
    block, dim, num_blocks = 4, 16, 40
    # (keys, queries): decode rows, a prompt, a chunk after a cached prefix
    seqs = [(1, 1), (9, 1), (23, 23), (37, 6)]
    kc = torch.zeros(num_blocks, block, n_kv, dim)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g) if scattered else torch.arange(num_blocks)
    tables = torch.zeros(len(seqs), 12, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for b, (n_keys, _) in enumerate(seqs):
        n_blocks = -(-n_keys // block)
        tables[b, :n_blocks] = perm[used : used + n_blocks]
        used += n_blocks
        k = torch.randn(n_keys, n_kv, dim, generator=g)
        v = torch.randn(n_keys, n_kv, dim, generator=g)
        pos = range(n_keys)
        slots = torch.tensor([int(tables[b, i // block]) * block + i % block for i in pos])
        write_kv(kc, vc, k, v, slots)
        ks.append(k), vs.append(v)
    starts = [0]
    for _, n_query in seqs:
        starts.append(starts[-1] + n_query)
    q = torch.randn(starts[-1], n_heads, dim, generator=g)
    out = paged_attention_ref(q, kc, vc, tables, starts, [s[0] for s in seqs], 0.25, window)
    for b, (n_keys, _) in enumerate(seqs):
        want = _dense(q[starts[b] : starts[b + 1]], ks[b], vs[b], n_keys, 0.25, window)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], want, rtol=1e-5, atol=1e-5)
