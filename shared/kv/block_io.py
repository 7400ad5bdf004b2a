"""A KV block's bytes outside the pool: one flat uint8 buffer per block, as the kvcache's RAM
slots and disk values hold it. The layout: every layer's K block then its V block
([block_size, n_kv_heads, head_dim] each, in the pool's dtype), in layer order; with an FP8
cache of per-token scales, then every layer's K and V scales ([block_size, n_kv_heads]
float32). An FP8 cache of per-head scales has no per-block scales: its blocks are only
meaningful beside the calibration that made them, so tiers refuse it (``tier_key``).

`save_block` / `load_block` copy one block piece by piece (2 x n_layers copies of a few KiB
each: fine on the CPU, slow over PCIe). `save_blocks` / `load_blocks` move many blocks at once:
on a GPU every block's pieces are gathered, one indexed copy per pool tensor for a whole group
of blocks, into a device `Staging` buffer that holds blocks in slot layout, and each block then
crosses to (or from) its host slot as one contiguous copy of block_bytes (near PCIe speed)."""

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


def _pool_tensors(kv: KVPool) -> list[torch.Tensor]:
    """The pool's tensors in slot order, each seen as bytes: [num_blocks, piece_bytes] uint8."""
    parts = [t for layer in range(len(kv.k)) for t in (kv.k[layer], kv.v[layer])]
    if kv.fp8:
        scales = zip(kv.k_scale_store, kv.v_scale_store, strict=True)
        parts += [s for pair in scales for s in pair]
    return [p.view(torch.uint8).view(p.shape[0], -1) for p in parts]


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


STAGING_BYTES = 64 << 20  # the device buffer a batched copy goes through, at most


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class Staging:
    """A device buffer of whole blocks in slot layout ([rows, block_bytes] uint8, allocated
    once) and, per pool tensor, its range in a row: where `save_blocks` gathers a group of
    blocks and `load_blocks` scatters one from. The gathers move the widest words that every
    piece's size allows (8 bytes for any real shape; byte by byte they were ~40x slower on
    the CPU)."""

    def __init__(self, kv: KVPool, max_bytes: int = STAGING_BYTES) -> None:
        if kv.head_scales:
            raise ValueError("an FP8 pool of per-head scales has no per-block scales to move")
        self.block_bytes = block_bytes(kv)
        self.rows = max(1, max_bytes // self.block_bytes)
        pool = _pool_tensors(kv)
        if sum(p.shape[1] for p in pool) != self.block_bytes:
            raise ValueError(f"the pool's blocks do not fill a slot of {self.block_bytes} bytes")
        word = next(w for w in _WORDS if all(p.shape[1] % w == 0 for p in pool))
        self.pool = [p.view(_WORDS[word]) for p in pool]  # [num_blocks, piece words]
        self.buf = torch.empty(
            (self.rows, self.block_bytes), dtype=torch.uint8, device=kv.k[0].device
        )
        self.words = self.buf.view(_WORDS[word])  # [rows, block words]
        self.ranges, off = [], 0
        for p in self.pool:
            self.ranges.append((off, off + p.shape[1]))
            off += p.shape[1]

    def groups(self, blocks: list[int]) -> list[tuple[int, torch.Tensor]]:
        """(first, block ids on the device) for each group of at most `rows` blocks."""
        dev = self.buf.device
        out = []
        for first in range(0, len(blocks), self.rows):
            ids = torch.tensor(blocks[first : first + self.rows], dtype=torch.int64)
            if dev.type == "cuda":
                ids = ids.pin_memory().to(dev, non_blocking=True)
            out.append((first, ids))
        return out


def _staging(kv: KVPool, blocks: list[int], bufs: list[torch.Tensor], staging: Staging | None,
             one) -> Staging | None:  # fmt: skip
    """The staging buffer a batched copy goes through (one made for the call if none is
    given); None when the pool is on the host and none is given: then each block was copied
    straight, piece by piece, by `one` (save_block or load_block)."""
    if len(blocks) != len(bufs):
        raise ValueError(f"{len(blocks)} blocks for {len(bufs)} buffers")
    if staging is None and not kv.k[0].is_cuda:
        for block, buf in zip(blocks, bufs, strict=True):
            one(kv, block, buf)
        return None
    return staging or Staging(kv, min(STAGING_BYTES, len(blocks) * block_bytes(kv)))


def save_blocks(
    kv: KVPool, blocks: list[int], bufs: list[torch.Tensor], staging: Staging | None = None
) -> None:
    """Each block of `blocks` into its buf (uint8 [block_bytes] host memory), bytes as
    save_block's. On the CPU without a staging buffer: save_block, block by block. On a
    GPU: per group of blocks one gather per pool tensor into the staging
    buffer (one made for this call if none is given), then one device->host copy per block,
    all queued on the current stream; the caller waits for them (an event) before anyone
    reads the bufs."""
    st = _staging(kv, blocks, bufs, staging, save_block)
    if st is None:
        return
    for first, ids in st.groups(blocks):
        n = ids.shape[0]
        for src, (lo, hi) in zip(st.pool, st.ranges, strict=True):
            torch.index_select(src, 0, ids, out=st.words[:n, lo:hi])
        for row in range(n):
            _check(bufs[first + row], st.block_bytes)
            bufs[first + row].copy_(st.buf[row], non_blocking=True)


def load_blocks(
    kv: KVPool, blocks: list[int], bufs: list[torch.Tensor], staging: Staging | None = None
) -> None:
    """Each buf's bytes into its block of `blocks` (the reverse of save_blocks): on a GPU one
    host->device copy per block into the staging buffer, then one indexed copy per pool
    tensor for the group; queued on the current stream (the bufs stay untouched until an
    event after this has passed)."""
    st = _staging(kv, blocks, bufs, staging, load_block)
    if st is None:
        return
    for first, ids in st.groups(blocks):
        n = ids.shape[0]
        for row in range(n):
            _check(bufs[first + row], st.block_bytes)
            st.buf[row].copy_(bufs[first + row], non_blocking=True)
        for dst, (lo, hi) in zip(st.pool, st.ranges, strict=True):
            dst.index_copy_(0, ids, st.words[:n, lo:hi])


def _check(buf: torch.Tensor, n: int) -> None:
    if buf.dtype != torch.uint8 or buf.numel() != n:
        raise ValueError(f"a slot of {buf.numel()} {buf.dtype} for a block of {n} bytes")
