"""Byte-level helpers shared by the block dequantizers.

Owns: viewing raw GGUF bytes as a ``(n_blocks, type_size)`` uint8 matrix, reading the
little-endian fp16 scale fields embedded in blocks, and unpacking packed 1/2/4-bit fields.

Bit twiddling uses only uint8, int8 and int32: torch has no CUDA kernels for shifts on
uint16/uint32, and every value involved is a small integer that is exact in any dtype.
Wider views of the raw bytes always go through ``aligned_copy`` because
``Tensor.view(dtype)`` to a wider type demands an aligned storage offset and strides.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType as T

__all__ = [
    "FP16_FIELDS",
    "aligned_copy",
    "as_blocks",
    "fp16_field",
    "int8_field",
    "shift_table",
    "unpack_bits",
]


# Byte offsets of the fp16 fields (d, and m / dmin) inside each block, from ggml's structs.
FP16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}  # fmt: skip


def as_blocks(data: torch.Tensor, type_size: int) -> torch.Tensor:
    """View ``data`` (raw bytes, any shape) as a ``(n_blocks, type_size)`` uint8 matrix."""
    flat = data.reshape(-1)
    if flat.numel() % type_size:
        raise ValueError(f"{flat.numel()} bytes is not a whole number of {type_size}-byte blocks")
    return flat.reshape(flat.numel() // type_size, type_size)


def fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """Read the fp16 at byte ``offset`` of every block as float32, shape ``(n_blocks, 1)``.

    The copy before the dtype view costs 2 bytes per block.
    """
    raw = aligned_copy(blocks[:, offset : offset + 2])
    return raw.view(torch.float16).to(torch.float32)


def int8_field(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Reinterpret bytes ``[start, stop)`` of every block as signed int8."""
    return blocks[:, start:stop].view(torch.int8)


def aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy at storage offset 0, so wider dtype views are always legal."""
    return t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=64)
def shift_table(
    shifts: tuple[int, ...], ndim: int, axis: int, device: torch.device
) -> torch.Tensor:
    """A uint8 tensor of ``shifts`` laid along ``axis`` of an ``ndim``-d broadcast shape.

    Cached per device so the per-matmul dequant path does not re-upload the same few bytes
    to the GPU on every call.
    """
    shape = [1] * ndim
    shape[axis] = len(shifts)
    return torch.tensor(shifts, dtype=torch.uint8, device=device).reshape(shape)


def unpack_bits(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Unpack ``bits``-wide fields the way gguf/ggml lay them out, lowest bits first.

    ``packed`` is ``(n_blocks, n_bytes)`` uint8, seen as chunks of ``group`` bytes. Each
    chunk expands to ``8 // bits`` runs of ``group`` values: run ``j`` holds bits
    ``[j * bits, (j + 1) * bits)`` of every byte in the chunk. The result is
    ``(n_blocks, n_bytes * 8 // bits)`` uint8, in (chunk, run, byte) order -- the same
    order gguf.quants produces with its ``reshape(..., 1, group) >> shifts`` idiom.

    The shifting is done four bytes at a time in int32 lanes with a byte-replicated mask
    (``0x0F0F0F0F`` for nibbles), which cannot leak bits across byte boundaries and is
    several times faster on CPU than broadcasting a uint8 shift; every group size used
    by the formats is a multiple of 4 bytes. Sign-extension of the arithmetic shift only
    touches the top byte's high bits, which the mask clears.
    """
    n_blocks, n_bytes = packed.shape
    n_chunks, lanes = n_bytes // group, group // 4
    per_byte = 8 // bits
    mask = int.from_bytes(bytes([(1 << bits) - 1]) * 4, "little")
    words = aligned_copy(packed).view(torch.int32).reshape(n_blocks, n_chunks, 1, lanes)
    out = torch.empty(
        (n_blocks, n_chunks, per_byte, lanes), dtype=torch.int32, device=packed.device
    )
    for run in range(per_byte):
        torch.bitwise_right_shift(words, run * bits, out=out[:, :, run : run + 1])
    out &= mask
    return out.view(torch.uint8).reshape(n_blocks, n_bytes * per_byte)
