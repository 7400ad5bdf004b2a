"""The Triton paged attention kernel agrees with the torch references in shared/ops.

On a CUDA device the kernel runs natively (larger shapes; `-m gpu` adds real model shapes); on
the CPU it runs under the Triton interpreter, which the environment must select before triton is
imported (TRITON_INTERPRET=1); this module sets nothing itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "the Triton kernel needs a CUDA device or TRITON_INTERPRET=1 (CPU interpreter)",
        allow_module_level=True,
    )

import triton  # noqa: E402

import shared.kernels.paged_attention as pa  # noqa: E402
from shared.ops.paged_attention import paged_attention_ref  # noqa: E402
from shared.ops.paged_attention_fp8 import (  # noqa: E402
    paged_attention_fp8_ref,
    quantize_kv_fp8,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NATIVE = DEVICE == "cuda" and not pa._interpreted()
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}

# (query lengths, cached-prefix lengths) per sequence; under the interpreter T stays <= 40.
SCENARIOS = {
    "prefill": ([9, 17, 3], [0, 0, 0]),
    "chunk": ([12, 5], [20, 37]),
    "decode": ([1, 1, 1, 1], [30, 5, 63, 0]),
    "mixed": ([1, 0, 14, 1, 6], [40, 9, 18, 0, 3]),
}


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]

    @property
    def max_query_len(self) -> int:
        starts = self.query_start_loc
        return max(starts[i + 1] - starts[i] for i in range(len(starts) - 1))


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = F32,
    seed: int = 0,
) -> Batch:
    """Random q and cache; blocks shuffled; unused slots, spare blocks and table tails poisoned."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    dev = {"device": DEVICE}
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    n_blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(n_blocks) + 3
    width = max(n_blocks) + 2
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, **dev)
    v_cache = torch.randn(shape, generator=g, **dev)
    perm = torch.randperm(num_blocks, generator=g, **dev).int()
    tables = torch.randint(0, num_blocks, (len(q_lens), width), generator=g, **dev).int()
    used = 0
    for b, (n_keys, nb) in enumerate(zip(seq_lens, n_blocks, strict=True)):
        tables[b, :nb] = perm[used : used + nb]
        used += nb
        if nb:  # slots past the end of the last block: never read, so poison them
            k_cache[int(perm[used - 1]), n_keys - (nb - 1) * block_size :] = float("nan")
            v_cache[int(perm[used - 1]), n_keys - (nb - 1) * block_size :] = float("nan")
    k_cache[perm[used:].long()] = float("nan")  # spare blocks: reachable only via table tails
    v_cache[perm[used:].long()] = float("nan")
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=g, **dev)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return Batch(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, starts, seq_lens)


def to_fp8(
    batch: Batch, q_dtype: torch.dtype, scale_dtype: torch.dtype = F32
) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """The batch with its cache quantized to FP8 (varied per-token scales); poisoned slots keep
    a NaN scale, so reading one still shows in the output."""
    caches = []
    for cache in (batch.k_cache, batch.v_cache):
        flat = cache.float().flatten(0, 1)
        poisoned = flat.isnan().any(-1)
        flat = torch.nan_to_num(flat) * torch.rand(flat.shape[:2] + (1,), device=DEVICE) * 8
        values, scales = quantize_kv_fp8(flat, scale_dtype)
        scales[poisoned] = float("nan")
        caches.append((values.view(cache.shape), scales.view(cache.shape[:3])))
    (k8, ks), (v8, vs) = caches
    fp8 = Batch(batch.q.to(q_dtype), k8, v8, batch.block_tables, batch.query_start_loc,
                batch.seq_lens)  # fmt: skip
    return fp8, ks, vs


def fp8_reference(batch: Batch, ks, vs, scale: float, window: int = 0) -> torch.Tensor:
    return paged_attention_fp8_ref(
        batch.q, batch.k_cache, batch.v_cache, ks, vs, batch.block_tables,
        batch.query_start_loc, batch.seq_lens, scale, window,
    )  # fmt: skip


def scenario(name: str) -> tuple[list[int], list[int]]:
    q_lens, ctx_lens = SCENARIOS[name]
    if NATIVE:  # the GPU affords longer contexts and chunks
        q_lens = [n * 9 if n > 1 else n for n in q_lens]
        ctx_lens = [c * 37 for c in ctx_lens]
    return q_lens, ctx_lens


def run_kernel(batch: Batch, scale: float, window: int = 0, **kw) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))  # rows the kernel misses stay NaN
    i32 = {"dtype": torch.int32, "device": batch.q.device}
    res = pa.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        torch.tensor(batch.query_start_loc, **i32),
        torch.tensor(batch.seq_lens, **i32),
        scale,
        window,
        max_query_len=batch.max_query_len,
        out=out,
        **kw,
    )
    assert res is out
    return out


def reference(batch: Batch, scale: float, window: int = 0) -> torch.Tensor:
    return paged_attention_ref(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
        scale,
        window,
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    bad = (~torch.isfinite(out)).flatten(1).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} not finite (not written, or read a poisoned slot)"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-row, 16-key tiles: several query tiles per sequence and KV tiles to skip, at tiny T."""

    def pick(max_query_len: int, group: int, head_dim: int, *_) -> pa._Tiles:
        return pa._Tiles(max(16, triton.next_power_of_2(group)), 16, 4, 1)

    monkeypatch.setattr(pa, "_pick_tiles", pick)


# scenario, dtype, GQA group, head_dim, sliding window, num_splits, block_size, small tiles
CASES = [
    ("prefill", F32, 1, 64, 0, 1, 16, True),
    ("prefill", F32, 4, 64, 7, 1, 8, False),
    ("chunk", F32, 4, 64, 0, 1, 16, True),
    ("chunk", F32, 3, 64, 8, 1, 8, True),
    ("chunk", F32, 1, 256, 0, 2, 16, False),
    ("decode", F32, 4, 64, 0, 3, 16, True),
    ("decode", F32, 1, 256, 8, 2, 16, True),
    ("decode", F32, 3, 64, 13, 1, 32, False),
    ("mixed", F32, 3, 64, 0, 3, 16, True),
    ("mixed", F32, 4, 256, 12, 1, 32, True),
    ("mixed", F32, 1, 64, 10, 4, 8, False),
    ("mixed", F16, 4, 64, 0, 1, 16, True),
    ("chunk", F16, 1, 256, 9, 2, 16, False),
    ("decode", F16, 3, 128, 0, 1, 8, False),
    ("mixed", BF16, 3, 64, 8, 3, 16, True),
    ("prefill", BF16, 4, 256, 0, 1, 16, False),
    ("decode", BF16, 4, 128, 0, 2, 16, True),
]


@pytest.mark.parametrize(
    "name,dtype,group,head_dim,window,splits,block_size,small", CASES, ids=lambda v: str(v)
)
def test_matches_reference(
    request, name, dtype, group, head_dim, window, splits, block_size, small
) -> None:
    if small:
        request.getfixturevalue("small_tiles")
    n_kv_heads = 2 if head_dim <= 64 else 1
    q_lens, ctx_lens = scenario(name)
    batch = make_batch(
        q_lens, ctx_lens, group * n_kv_heads, n_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = run_kernel(batch, scale, window, num_splits=splits)
    assert_close(out, reference(batch, scale, window), TOL[dtype])


def test_q_and_cache_views(small_tiles) -> None:
    """q sliced from a fused QKV projection, K/V from one [blocks, 2, ...] tensor."""
    batch = make_batch(*scenario("mixed"), n_heads=4, n_kv_heads=2, head_dim=64, block_size=16)
    t, h, d = batch.q.shape
    qkv = torch.randn(t, (h + 4) * d, device=DEVICE)
    qkv[:, : h * d] = batch.q.reshape(t, h * d)
    kv = torch.stack([batch.k_cache, batch.v_cache], dim=1)
    view = Batch(qkv[:, : h * d].view(t, h, d), kv[:, 0], kv[:, 1], batch.block_tables,
                 batch.query_start_loc, batch.seq_lens)  # fmt: skip
    assert not view.q.is_contiguous() and not view.k_cache.is_contiguous()
    out = run_kernel(view, 0.125, 8, num_splits=2)
    assert_close(out, reference(batch, 0.125, 8), TOL[F32])


def test_window_never_reads_blocks_outside_it(small_tiles) -> None:
    """Blocks wholly before the first key tile a window reaches are NaN: they must not be loaded."""
    window, tile_n, block_size = 9, 16, 16
    q_lens, ctx_lens = [1, 1, 6], [70, 41, 50]
    batch = make_batch(
        q_lens, ctx_lens, n_heads=4, n_kv_heads=1, head_dim=64, block_size=block_size
    )
    ref = reference(batch, 0.125, window)
    poisoned = 0
    for b, ctx in enumerate(ctx_lens):
        first_read = max(ctx - window + 1, 0) // tile_n * tile_n
        for j in range(first_read // block_size):
            batch.k_cache[int(batch.block_tables[b, j])] = float("nan")
            batch.v_cache[int(batch.block_tables[b, j])] = float("nan")
            poisoned += 1
    assert poisoned >= 6
    for splits in (1, 3):
        assert_close(run_kernel(batch, 0.125, window, num_splits=splits), ref, TOL[F32])


def test_no_tokens_and_idle_sequences() -> None:
    batch = make_batch([0, 0], [5, 9], n_heads=2, n_kv_heads=1, head_dim=64)
    assert run_kernel(batch, 0.125).shape == (0, 2, 64)
    batch = make_batch([0, 3, 0], [5, 9, 2], n_heads=2, n_kv_heads=1, head_dim=64)
    assert_close(run_kernel(batch, 0.125), reference(batch, 0.125), TOL[F32])


def test_padded_like_a_mixed_step_graph(small_tiles) -> None:
    """The layout of a replayed mixed step: tokens padded past the real ones (belonging to no
    sequence), zero-length sequences appended, max_query_len the padded size. Real rows equal
    the unpadded launch; padding rows are never written."""
    batch = make_batch([1, 9, 1, 6], [20, 0, 7, 11], n_heads=4, n_kv_heads=2, head_dim=32)
    want = run_kernel(batch, 0.2)
    t, pad_t, pad_s = batch.q.shape[0], 16, 3
    q = torch.cat([batch.q, torch.randn(pad_t, *batch.q.shape[1:], device=DEVICE)])
    tables = torch.cat([batch.block_tables, batch.block_tables[:pad_s] * 0])
    i32 = {"dtype": torch.int32, "device": DEVICE}
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        tables,
        torch.tensor(batch.query_start_loc + [t] * pad_s, **i32),
        torch.tensor(batch.seq_lens + [0] * pad_s, **i32),
        0.2,
        max_query_len=t + pad_t,
        out=out,
    )
    assert torch.equal(out[:t], want)
    assert torch.isnan(out[t:]).all()


# Real shapes on the GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "q_lens,ctx_lens,window,fp8",
    [
        ([1] * 64, [4096 - 1 - 37 * i for i in range(64)], 0, False),  # 64 decodes, ~4k context
        ([2048, 1, 1], [6144, 3000, 100], 0, False),  # a 2k chunk over a 6k prefix + decodes
        ([1, 1], [32767, 20000], 0, False),  # long decode: auto split-K
        ([1, 1, 512], [32767, 9000, 4096], 1024, False),  # sliding window at long context
        ([1] * 16, [4095] * 16, 0, True),  # FP8 cache
    ],
    ids=["decode64x4k", "prefill2k_over6k", "decode32k", "window1k", "fp8_decode16x4k"],
)
def test_gpu_real_shapes(q_lens, ctx_lens, window, fp8) -> None:
    if not NATIVE:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8e4nv loads need sm_89+")
    batch = make_batch(q_lens, ctx_lens, n_heads=32, n_kv_heads=8, head_dim=128, dtype=BF16)
    scale = 128**-0.5
    hint = {"max_seq_len": max(c + n for c, n in zip(ctx_lens, q_lens, strict=True))}
    if fp8:
        batch, ks, vs = to_fp8(batch, BF16)
        out = run_kernel(batch, scale, window, k_scale=ks, v_scale=vs, **hint)
        ref = fp8_reference(batch, ks, vs, scale, window)
    else:
        out = run_kernel(batch, scale, window, **hint)
        ref = reference(batch, scale, window)
    assert_close(out, ref, TOL[BF16])


@pytest.mark.parametrize("name", ["decode", "chunk", "mixed"])
def test_one_sequence_without_the_search_gives_the_same_bits(name) -> None:
    """A batch of one sequence takes it without _find_seq's search: its output is, bit for
    bit, that sequence's rows of the scenario's whole batch (whose programs search for their
    sequence), with the same tiles (its longest query) and splits."""
    q_lens, ctx_lens = scenario(name)
    batch = make_batch(q_lens, ctx_lens, 8, 2, 64, 16, F32)
    b = q_lens.index(max(q_lens))
    lo, hi = batch.query_start_loc[b], batch.query_start_loc[b + 1]
    one = Batch(batch.q[lo:hi], batch.k_cache, batch.v_cache, batch.block_tables[b : b + 1],
                [0, hi - lo], batch.seq_lens[b : b + 1])  # fmt: skip
    assert one.max_query_len == batch.max_query_len
    direct = run_kernel(one, 0.125, 0, num_splits=2)
    searched = run_kernel(batch, 0.125, 0, num_splits=2)
    assert torch.equal(direct, searched[lo:hi])
    assert_close(direct, reference(one, 0.125), TOL[F32])
    assert_close(searched, reference(batch, 0.125), TOL[F32])
