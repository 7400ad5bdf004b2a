"""The KV cache tensors of one device: per layer K and V as [blocks, block_size, kv_heads, dim]."""

from __future__ import annotations

import torch

from shared.ops.paged_attention_fp8 import FP8

SCALE_MODES = ("token", "head")  # an FP8 cache's scales: per (token, KV head), or per KV head


class KVPool:
    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scales: str = "token",
    ) -> None:
        if scales not in SCALE_MODES:
            raise ValueError(f"KV scales {scales!r}: one of {', '.join(SCALE_MODES)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.dtype = dtype
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        # FP8 (e4m3) caches carry float32 scales: one per token and KV head, written with the
        # token, or one per KV head of a layer ("head": set by shared.kv.calibrate, stored once
        # and seen as [blocks, block_size, kv_heads] with block and slot strides 0)
        self.fp8 = dtype == FP8
        self.head_scales = self.fp8 and scales == "head"
        n = n_layers if self.fp8 else 0
        per = (n_kv_heads,) if self.head_scales else (num_blocks, block_size, n_kv_heads)
        self.k_scale_store = [torch.ones(per, dtype=torch.float32, device=device) for _ in range(n)]
        self.v_scale_store = [torch.ones(per, dtype=torch.float32, device=device) for _ in range(n)]
        view = (num_blocks, block_size, n_kv_heads)
        self.k_scale = [s.expand(view) for s in self.k_scale_store]
        self.v_scale = [s.expand(view) for s in self.v_scale_store]

    @staticmethod
    def bytes_per_block(
        n_layers: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scales: str = "token",
    ) -> int:
        per_token_head = head_dim * dtype.itemsize
        if dtype == FP8 and scales == "token":
            per_token_head += 4  # its scale
        return 2 * n_layers * block_size * n_kv_heads * per_token_head
