"""Paged KV cache: the device tensors and the manager of their fixed-size blocks."""

from shared.kv.block_manager import BlockManager, OutOfBlocks
from shared.kv.kv_pool import KVPool

__all__ = ["BlockManager", "KVPool", "OutOfBlocks"]
