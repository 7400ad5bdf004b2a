"""A KV block's bytes outside the pool: one flat uint8 buffer per block, as the kvcache's RAM
slots and disk values hold it. The layout: every layer's K block then its V block
([block_size, n_kv_heads, head_dim] each, in the pool's dtype), in layer order; with an FP8
cache of per-token scales, then every layer's K and V scales ([block_size, n_kv_heads]
float32). An FP8 cache of per-head scales has no per-block scales: its blocks are only
meaningful beside the calibration that made them, so tiers refuse it (``tier_key``)."""

from __future__ import annotations

import hashlib

import torch

from shared.kv.kv_pool import KVPool


def block_bytes(kv: KVPool) -> int:
    n_layers = len(kv.k)
    _, block_size, n_kv_heads, head_dim = kv.k[0].shape
    return KVPool.bytes_per_block(
        n_layers, block_size, n_kv_heads, head_dim, kv.dtype, "head" if kv.head_scales else "token"
    )


def tier_key(kv: KVPool, model_identity: bytes) -> str | None:
    """The model key a tier files this pool's blocks under (hex), None if they cannot leave
    the pool: the model file's identity, the KV dtype, the block shape and the layer count."""
    if kv.head_scales:
        return None
    shape = "x".join(str(d) for d in kv.k[0].shape[1:])
    text = f"{model_identity.decode(errors='replace')}|{kv.dtype}|{shape}|{len(kv.k)}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _tensors(kv: KVPool, block: int) -> list[torch.Tensor]:
    parts = [t[block] for layer in range(len(kv.k)) for t in (kv.k[layer], kv.v[layer])]
    if kv.fp8:
        scales = zip(kv.k_scale_store, kv.v_scale_store, strict=True)
        parts += [s[block] for pair in scales for s in pair]
    return parts


def _views(buf: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in parts:
        n = p.numel() * p.element_size()
        out.append(buf[off : off + n].view(p.dtype).view(p.shape))
        off += n
    if off != buf.numel():
        raise ValueError(f"a block of {off} bytes does not fill a slot of {buf.numel()}")
    return out


def save_block(kv: KVPool, block: int, buf: torch.Tensor) -> None:
    """Block `block` of the pool into buf (uint8 [block_bytes], host memory). On a GPU the
    copies are queued on the current stream (after the step that wrote the block); the caller
    waits for them (an event) before anyone reads buf."""
    parts = _tensors(kv, block)
    for dst, src in zip(_views(buf, parts), parts, strict=True):
        dst.copy_(src, non_blocking=True)


def load_block(kv: KVPool, block: int, buf: torch.Tensor) -> None:
    """buf's bytes into block `block` of the pool (the reverse of save_block)."""
    parts = _tensors(kv, block)
    for src, dst in zip(_views(buf, parts), parts, strict=True):
        dst.copy_(src, non_blocking=True)
