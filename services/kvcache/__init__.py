"""KV cache service (block index, RAM and LMDB tiers, block moves): lands with the KV tiers."""
