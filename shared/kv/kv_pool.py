"""The KV cache tensors of one device: per layer K and V as [blocks, block_size, kv_heads, dim]."""

from __future__ import annotations

import torch


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
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.dtype = dtype
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        # FP8 (e4m3) caches carry one float32 scale per token and KV head
        self.fp8 = dtype == torch.float8_e4m3fn
        scales = (num_blocks, block_size, n_kv_heads)
        n = n_layers if self.fp8 else 0
        self.k_scale = [torch.ones(scales, dtype=torch.float32, device=device) for _ in range(n)]
        self.v_scale = [torch.ones(scales, dtype=torch.float32, device=device) for _ in range(n)]

    @staticmethod
    def bytes_per_block(
        n_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        per_token_head = head_dim * dtype.itemsize
        if dtype == torch.float8_e4m3fn:
            per_token_head += 4  # its scale
        return 2 * n_layers * block_size * n_kv_heads * per_token_head
