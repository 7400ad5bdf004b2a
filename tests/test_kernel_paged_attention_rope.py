"""Decode attention with the step's RoPE and KV write folded in (``paged_attention(...,
rope_kv=RopeKV(...))``): its output and its cache equal those of ``rope_and_write_kv`` followed by
``paged_attention``, the two launches it replaces. The new keys' slots start poisoned (NaN), so a
program that read one back from the cache instead of its registers shows. Helpers and the
interpreter / GPU selection: tests/test_kernel_paged_attention.py."""

from __future__ import annotations

import pytest
import torch

from shared.kernels.rope_kv import rope_and_write_kv
from shared.kernels.rope_rows import RopeKV
from tests.test_kernel_paged_attention import (
    BF16,
    DEVICE,
    F32,
    NATIVE,
    TOL,
    assert_close,
    make_batch,
    pa,
    small_tiles,  # noqa: F401 - the fixture (getfixturevalue)
)

I32 = {"dtype": torch.int32, "device": DEVICE}
I64 = {"dtype": torch.int64, "device": DEVICE}


def _decode_case(ctx_lens, n_heads, n_kv, head_dim, block_size, dtype, seed=1):
    """A decode batch, raw q/k/v as views of one fused projection, the new keys' slots (their
    last position; one sequence with no token) poisoned in both caches."""
    q_lens = [0 if c < 0 else 1 for c in ctx_lens]
    ctx = [max(c, 0) for c in ctx_lens]
    batch = make_batch(q_lens, ctx, n_heads, n_kv, head_dim, block_size, dtype, seed)
    t = sum(q_lens)
    g = torch.Generator(DEVICE).manual_seed(seed + 7)
    qkv = torch.randn(t, (n_heads + 2 * n_kv) * head_dim, generator=g, device=DEVICE).to(dtype)
    q = qkv[:, : n_heads * head_dim].view(t, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv) * head_dim].view(t, n_kv, head_dim)
    v = qkv[:, (n_heads + n_kv) * head_dim :].view(t, n_kv, head_dim)
    slots, positions = [], []
    for b, (n, c) in enumerate(zip(q_lens, ctx, strict=True)):
        if n:
            block = int(batch.block_tables[b, c // block_size])
            slots.append(block * block_size + c % block_size)
            positions.append(c + 3)  # not the context: the angles must come from positions
    slots_t, pos_t = torch.tensor(slots, **I64), torch.tensor(positions, **I64)
    for cache in (batch.k_cache, batch.v_cache):
        cache.view(-1, n_kv, head_dim)[slots_t] = float("nan")
    return batch, q, k, v, pos_t, slots_t


def _attend(batch, q, k_cache, v_cache, splits, rope_kv=None):
    return pa.paged_attention(
        q, k_cache, v_cache, batch.block_tables, torch.tensor(batch.query_start_loc, **I32),
        torch.tensor(batch.seq_lens, **I32), q.shape[-1] ** -0.5, max_query_len=1,
        num_splits=splits, rope_kv=rope_kv,
    )  # fmt: skip


# ctx lens (-1: a sequence with no token), GQA group, kv heads, head_dim, rope_dim (the whole
# head), neox, freq factors, block size, splits, dtype, small tiles
CASES = [
    ([30, 5, 63, 0], 4, 2, 64, 64, False, False, 16, 1, F32, True),
    ([30, 5, 63, 0], 4, 2, 64, 64, True, False, 16, 3, F32, True),
    ([47, -1, 16, 2], 2, 2, 64, 64, True, True, 8, 16, F32, True),  # more splits than tiles
    ([70, 33, 15], 3, 1, 128, 128, False, False, 16, 2, BF16, False),
    ([70, 33, 15], 4, 2, 128, 128, True, True, 16, 1, BF16, True),
]


@pytest.mark.parametrize(
    "ctx,group,n_kv,head_dim,rope_dim,neox,ff,block_size,splits,dtype,small",
    CASES,
    ids=lambda v: str(v),
)
def test_folded_rope_and_write_match_the_two_launches(
    request, ctx, group, n_kv, head_dim, rope_dim, neox, ff, block_size, splits, dtype, small
) -> None:
    if small:
        request.getfixturevalue("small_tiles")
    if NATIVE:
        ctx = [c * 37 if c > 0 else c for c in ctx]
    batch, q, k, v, pos, slots = _decode_case(ctx, group * n_kv, n_kv, head_dim, block_size, dtype)
    factors = torch.linspace(1.0, 4.0, rope_dim // 2, device=DEVICE) if ff else None
    rope = (rope_dim, 10000.0, neox, 2.0, factors)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    q_rot = rope_and_write_kv(q, k, v, pos, kc, vc, slots, *rope)
    want = _attend(batch, q_rot, kc, vc, splits)

    kf, vf = batch.k_cache.clone(), batch.v_cache.clone()
    got = _attend(batch, q, kf, vf, splits, RopeKV(k, v, pos, slots, *rope))
    assert_close(got, want, TOL[dtype] / 10)
    if NATIVE:  # the compiler may contract the rotation's products differently
        torch.testing.assert_close(kf, kc, rtol=TOL[dtype] / 10, atol=1e-6, equal_nan=True)
    else:
        assert torch.equal(kf.view(torch.uint8), kc.view(torch.uint8))
    assert torch.equal(vf.view(torch.uint8), vc.view(torch.uint8))  # every value slot written
    assert not kf.view(-1, n_kv, head_dim)[slots].isnan().any()


def test_folded_rope_rejects_what_it_cannot_do() -> None:
    batch, q, k, v, pos, slots = _decode_case([9, 4], 4, 2, 64, 16, F32)
    args = (batch.block_tables, torch.tensor(batch.query_start_loc, **I32))
    args += (torch.tensor(batch.seq_lens, **I32), 0.125)
    rope = RopeKV(k, v, pos, slots, 64, 10000.0, False)
    with pytest.raises(ValueError, match="decode"):
        pa.paged_attention(q, batch.k_cache, batch.v_cache, *args, max_query_len=2, rope_kv=rope)
    bad = RopeKV(k, v, pos.int(), slots, 64, 10000.0, False)
    with pytest.raises(ValueError, match="positions"):
        pa.paged_attention(q, batch.k_cache, batch.v_cache, *args, max_query_len=1, rope_kv=bad)
    for rope_dim in (63, 32):  # only whole heads rotate in the attention programs
        part = RopeKV(k, v, pos, slots, rope_dim, 10000.0, False)
        with pytest.raises(ValueError, match="rope_dim"):
            pa.paged_attention(
                q, batch.k_cache, batch.v_cache, *args, max_query_len=1, rope_kv=part
            )
    assert RopeKV.foldable(128, 128) and not RopeKV.foldable(64, 128)
    assert not RopeKV.foldable(80, 80)
