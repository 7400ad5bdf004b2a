"""save_blocks / load_blocks (many KV blocks at once, through a staging buffer) against
save_block / load_block (piece by piece): the same slot bytes for float32, float16 and FP8 pools
with per-token scales, round trips, groups larger than the staging buffer; on the CPU, and on a
GPU (marked `gpu`) into pinned host memory."""

from __future__ import annotations

import pytest
import torch

from shared.kv.block_io import Staging, block_bytes, load_blocks, save_block, save_blocks
from shared.kv.kv_pool import KVPool

DTYPES = [torch.float32, torch.float16, torch.float8_e4m3fn]
BLOCKS = [7, 2, 11, 5, 0, 9, 3]  # out of order, as a pool's free list hands them out


def _pool(dtype: torch.dtype, device: str, seed: int = 0) -> KVPool:
    kv = KVPool(3, 12, 4, 2, 8, dtype, device)
    g = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    for s in kv.k_scale_store + kv.v_scale_store:
        s.copy_(torch.rand(s.shape, generator=g) + 0.5)
    return kv


def _reference(kv: KVPool, blocks: list[int]) -> torch.Tensor:
    out = torch.zeros(len(blocks), block_bytes(kv), dtype=torch.uint8)
    for i, b in enumerate(blocks):
        save_block(kv, b, out[i])
    return out


def _pool_bytes(kv: KVPool, blocks: list[int]) -> list[bytes]:
    """Each block's bytes as the pool holds them (K, V, scales of every layer)."""
    parts = [*kv.k, *kv.v, *kv.k_scale_store, *kv.v_scale_store]
    return [b"".join(p[b].cpu().view(torch.uint8).numpy().tobytes() for p in parts) for b in blocks]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 1, 3, 64])  # 0: no staging (straight copies)
def test_save_blocks_bytes_equal_save_block(dtype: torch.dtype, rows: int) -> None:
    kv = _pool(dtype, "cpu")
    ref = _reference(kv, BLOCKS)
    assert ref.any(dim=1).all()  # every block's slot holds data, not zeros
    staging = Staging(kv, rows * block_bytes(kv)) if rows else None
    out = torch.zeros_like(ref)
    save_blocks(kv, BLOCKS, list(out), staging)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 2, 64])
def test_load_blocks_round_trips(dtype: torch.dtype, rows: int) -> None:
    src = _pool(dtype, "cpu", seed=1)
    slots = _reference(src, BLOCKS)
    dst = _pool(dtype, "cpu", seed=2)
    before = _pool_bytes(dst, range(dst.num_blocks))
    targets = [1, 10, 4, 6, 8, 0, 2]
    staging = Staging(dst, rows * block_bytes(dst)) if rows else None
    load_blocks(dst, targets, list(slots), staging)
    assert _pool_bytes(dst, targets) == _pool_bytes(src, BLOCKS)
    untouched = [b for b in range(dst.num_blocks) if b not in targets]
    assert _pool_bytes(dst, untouched) == [before[b] for b in untouched]


def test_staging_is_bounded_and_groups_cover_every_block() -> None:
    kv = _pool(torch.float16, "cpu")
    bb = block_bytes(kv)
    st = Staging(kv, 3 * bb + bb // 2)
    assert st.rows == 3 and tuple(st.buf.shape) == (3, bb)
    groups = st.groups(BLOCKS)
    assert [first for first, _ in groups] == [0, 3, 6]
    assert [b for _, ids in groups for b in ids.tolist()] == BLOCKS
    assert Staging(kv, 1).rows == 1  # never less than one block


def test_mismatched_buffers_are_refused() -> None:
    kv = _pool(torch.float16, "cpu")
    st = Staging(kv)
    with pytest.raises(ValueError, match="2 blocks for 1 buffers"):
        save_blocks(kv, [0, 1], [torch.zeros(block_bytes(kv), dtype=torch.uint8)], st)
    with pytest.raises(ValueError, match="a slot of"):
        save_blocks(kv, [0], [torch.zeros(block_bytes(kv) - 2, dtype=torch.uint8)], st)
    head = KVPool(1, 2, 4, 2, 8, torch.float8_e4m3fn, "cpu", scales="head")
    with pytest.raises(ValueError, match="per-head scales"):
        Staging(head)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_blocks_through_staging_into_pinned_slots(dtype: torch.dtype) -> None:
    cpu = _pool(dtype, "cpu", seed=3)
    kv = _pool(dtype, "cuda", seed=3)
    ref = _reference(cpu, BLOCKS)
    slots = torch.zeros_like(ref).pin_memory()
    staging = Staging(kv, 2 * block_bytes(kv))  # several groups
    save_blocks(kv, BLOCKS, list(slots), staging)
    torch.cuda.synchronize()
    assert torch.equal(slots, ref)
    back = _pool(dtype, "cuda", seed=4)
    targets = [0, 3, 1, 8, 10, 2, 6]
    load_blocks(back, targets, list(slots), staging=None)  # a staging buffer of its own
    torch.cuda.synchronize()
    assert _pool_bytes(back, targets) == _pool_bytes(cpu, BLOCKS)


def test_copy_bench_reports_every_path_and_equal_bytes() -> None:
    from tools.bench_copies import copy_bench

    out = copy_bench("cpu", n_blocks=6, n_layers=2, kv_dtype="fp8", repeats=1)
    assert out["bytes_equal"] is True
    assert out["block_bytes"] == 2 * 2 * 16 * 8 * (128 + 4)  # fp8 and its float32 scales
    for path in ("save_blocks", "save_block", "pinned_d2h", "load_blocks", "load_block"):
        assert out[f"{path}_gbps"] > 0
