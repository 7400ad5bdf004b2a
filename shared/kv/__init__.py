"""Paged KV cache: the device tensors and the allocator of their fixed-size blocks."""

from shared.kv.block_allocator import BlockAllocator, OutOfBlocks
from shared.kv.kv_pool import KVPool

__all__ = ["BlockAllocator", "KVPool", "OutOfBlocks"]
