"""KV block copies between a pool and host slots, in GB/s (``tools.bench_tiers --copy-bench``):
the batched path (save_blocks / load_blocks through a staging buffer), the piece-by-piece path
(save_block / load_block: 2 x n_layers copies a block) and, for the ceiling, one plain pinned
copy of the same bytes, each way. On the CPU the same runs (the host's memcpy speed)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shared.kv.block_io import (
    Staging,
    block_bytes,
    load_block,
    load_blocks,
    save_block,
    save_blocks,
)
from shared.kv.kv_dtype import NAMES
from shared.kv.kv_pool import KVPool

SHAPE_8B = {"block_size": 16, "n_kv_heads": 8, "head_dim": 128}  # Llama-3-8B's KV layout


def _timed(fn: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    """The best of `repeats` runs of fn, in seconds (after one warm-up)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bench(
    device: str, n_blocks: int, n_layers: int = 32, kv_dtype: str = "float16", repeats: int = 3
) -> dict[str, object]:
    dtype = NAMES[kv_dtype]
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pool_blocks = n_blocks + n_blocks // 4  # some the copies skip, as in a pool in use
    kv = KVPool(n_layers, pool_blocks, SHAPE_8B["block_size"], SHAPE_8B["n_kv_heads"],
                SHAPE_8B["head_dim"], dtype, device)  # fmt: skip
    for t in kv.k + kv.v:
        t.view(torch.uint8).random_(0, 120)  # finite values in every dtype
    bb = block_bytes(kv)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(pool_blocks, generator=g)[:n_blocks].tolist()
    slots = torch.randperm(n_blocks, generator=g).tolist()
    host = torch.empty((n_blocks, bb), dtype=torch.uint8, pin_memory=cuda)
    bufs = [host[s] for s in slots]
    staging = Staging(kv)
    flat_dev = torch.empty(n_blocks * bb, dtype=torch.uint8, device=device)
    flat_host = host.view(-1)

    def per_piece_save() -> None:
        for b, buf in zip(blocks, bufs, strict=True):
            save_block(kv, b, buf)

    def per_piece_load() -> None:
        for b, buf in zip(blocks, bufs, strict=True):
            load_block(kv, b, buf)

    runs = {
        "save_blocks": lambda: save_blocks(kv, blocks, bufs, staging),
        "save_block": per_piece_save,
        "pinned_d2h": lambda: flat_host.copy_(flat_dev, non_blocking=True),
        "load_blocks": lambda: load_blocks(kv, blocks, bufs, staging),
        "load_block": per_piece_load,
        "pinned_h2d": lambda: flat_dev.copy_(flat_host, non_blocking=True),
    }
    moved = n_blocks * bb
    out: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "kv_dtype": kv_dtype, "layers": n_layers, "block_bytes": bb, "blocks": n_blocks,
        "staging_blocks": staging.rows,
    }  # fmt: skip
    for name, fn in runs.items():
        out[f"{name}_gbps"] = round(moved / _timed(fn, sync, repeats) / 1e9, 2)
    # the batched path's bytes are the piece-by-piece path's
    check = torch.empty_like(host)
    save_blocks(kv, blocks, list(check), staging)
    ref = torch.empty_like(host)
    for i, b in enumerate(blocks):
        save_block(kv, b, ref[i])
    sync()
    out["bytes_equal"] = bool(torch.equal(check, ref))
    return out
