"""How a paged-attention launch is shaped (shared.kernels.paged_attention): the tiles a program
walks the keys in, its warps and pipeline stages, and the split-K counts of decode batches and
of steps with prompt chunks. Host-side rules only, measured on the H200 (BENCHMARKS.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

FP8 = torch.float8_e4m3fn
# Split-K: a slice shorter than this many keys costs more in the combine pass than it wins.
_SPLIT_MIN_KEYS = 2048  # H200: shorter slices lost to the combine pass (B=16, 1k ctx: 140 vs 63 us)
# ... except in batches of fewer than num_sms / 2 programs, where one key tile a slice wins
# (H200, graph-replayed, BENCHMARKS.md 2026-11-30 (g): B=1 at 512 keys 13.7 -> 7.4 us with 8
# slices of 64 keys; (y): 6.8 us with 4 of 128, 7.3 with 8, half of them empty)
# at most this many (H200, graph-replayed, BENCHMARKS.md 2026-11-30 (w): batch 1 over 32k keys
# took 101 us with 16 slices and 59 with 32, bf16 and FP8 alike; 2k and 8k gained 24-37 %)
_MAX_SPLITS = 32
# decode over contexts of at least this many keys reads them in 128-key tiles (decode_tile_keys),
# on devices that give a program this much shared memory (a 16-bit tile's two stages take 72 KB;
# sm_75's 64 KB would refuse the launch)
LONG_DECODE_KEYS = 8192
_LONG_TILE_SHARED_MEMORY = 96 * 1024
# one sequence decoding over contexts of at most this many keys reads them in 32-key tiles:
# every tile its own slice (_MAX_SPLITS of them), a program of 116 registers instead of 168
# (sm_90). H200, W1 (513-640 keys, BENCHMARKS.md 2026-12-02 (am)): Q4_K_M +2.1 %, Q6_K +1.3 %,
# Q8_0 +1.0 %; batch 2 lost 1.0 % and batch 4 gained 0.2 %, so batches keep 64 keys
SHORT_DECODE_KEYS = 1024
# Steps with prompt chunks: a chunk of a few hundred tokens over a long prefix runs fewer long
# programs than the GPU has SMs (384 tokens at GQA 4: 12 query tiles x 8 KV heads = 96 programs
# for 132 SMs, each walking the whole prefix). Such steps split too, when the prefix is long.
# cached keys before a chunk is worth splitting (H200, 256 tokens: 2 slices lost 26 % over 4k
# keys and won 19-27 % over 16k and 28k; 8k was not measured)
CHUNK_SPLIT_MIN_CONTEXT = 8192
_CHUNK_SPLIT_MIN_KEYS = 1024  # keys a slice at least
_CHUNK_SPLIT_ROWS = 4096  # slices x tokens at most: the float32 workspace of one layer's step

__all__ = [
    "CHUNK_SPLIT_MIN_CONTEXT",
    "FP8",
    "LONG_DECODE_KEYS",
    "SHORT_DECODE_KEYS",
    "Tiles",
    "chunk_num_splits",
    "chunk_split_limit",
    "decode_tile_keys",
    "default_num_splits",
    "pick_tiles",
]


@dataclass(frozen=True)
class Tiles:
    block_m: int  # rows per program: query tokens x the q heads of one KV head
    tile_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int
    per_sm: int = 1  # programs an SM holds at once (registers, shared memory): split-K's slots


def decode_tile_keys(
    head_dim: int,
    cache_dtype: torch.dtype,
    max_kv_len: int,
    shared_memory: int = 1 << 30,
    seqs: int = 0,
) -> int:
    """Keys a decode program's tile holds, for seqs sequences (0: not known, as a batch of
    several) over contexts of up to max_kv_len keys on a device that gives a program
    shared_memory bytes (device.max_shared_memory; default: no limit).

    One sequence with a 16-bit cache over at most SHORT_DECODE_KEYS keys: 32 (see there).

    H200 (BENCHMARKS.md 2026-11-30 (y)): graph-replayed alone, 128-key tiles beat 64-key ones
    for 16-bit and FP8 caches from 2k keys on (batch 1 over 32k: bf16 59.4 -> 45.1 us, FP8
    58.8 -> 43.9; batch 16: 791 -> 530, 762 -> 559; batch 64 FP8: 2,588 -> 1,738, bf16 even).
    A program's loop is a chain of dependent steps (dot, row max across warps, exp, dot), so
    its time goes by iterations more than by bytes. In the engine they gave W6 (32k) +12.5 %
    (bf16) and +13.7 % (FP8), but cost W1 (512-640 keys) 5 %, which the kernel alone did not
    show. So contexts from LONG_DECODE_KEYS on take them (the crossover between 640 and 32k
    keys was not measured in the engine). float32 caches, heads over 128 and devices with less
    shared memory a program than _LONG_TILE_SHARED_MEMORY keep the smaller tiles."""
    if (
        head_dim <= 128
        and cache_dtype.itemsize <= 2
        and max_kv_len >= LONG_DECODE_KEYS
        and shared_memory >= _LONG_TILE_SHARED_MEMORY
    ):
        return 128
    if seqs == 1 and head_dim <= 128 and cache_dtype.itemsize == 2:
        return 32 if max_kv_len <= SHORT_DECODE_KEYS else 64
    return 64 if head_dim <= 128 else 32


def pick_tiles(
    max_query_len: int,
    group: int,
    head_dim: int,
    cache_dtype: torch.dtype = torch.bfloat16,
    small_grid: bool = False,
    max_kv_len: int = 0,
    shared_memory: int = 1 << 30,
    seqs: int = 0,
) -> Tiles:
    """Tiles of a launch. Decode (max_query_len 1): small_grid, the grid has at most two
    programs an SM; max_kv_len, shared_memory and seqs as decode_tile_keys takes them."""
    tile_n = 64 if head_dim <= 128 else 32
    rows = triton.next_power_of_2(group)
    if max_query_len <= 1:  # decode: one token per sequence, its GQA group fills the rows
        keys = decode_tile_keys(head_dim, cache_dtype, max_kv_len, shared_memory, seqs)
        if keys == 128 and cache_dtype == FP8:
            return Tiles(max(16, rows), keys, 4, 3)
        if keys == 128:
            # 8 warps won where the grid leaves SMs half empty (batch 1 at 32k: 45.1 against
            # 48.2 us with 4; batch 16: 530 against 566), 4 in full grids (batch 64 over 8k:
            # 504 against 513) (y); FP8 lost with 8 warps everywhere (not explained: its
            # bytes reach the dot's layout through shared memory one at a time)
            return Tiles(max(16, rows), keys, 8 if small_grid else 4, 2)
        return Tiles(max(16, rows), keys, 4, 3)
    if head_dim <= 128 and max_query_len <= 512:
        # H200, chunks of 256-512 tokens over 4k-28k prefixes (BENCHMARKS.md 2026-11-30 (l)):
        # 64-row tiles of 4 warps, two a SM, beat 128-row tiles of 8 warps by 12-40 %
        return Tiles(max(64, rows), tile_n, 4, 2, per_sm=2)
    block_m = 128 if head_dim <= 128 else 64
    return Tiles(max(block_m, rows), tile_n, 8, 2)


def default_num_splits(
    num_seqs: int, n_kv_heads: int, max_kv_len: int, num_sms: int, tile_keys: int = 64
) -> int:
    """Split-K factor for a decode-only batch.

    Without splitting a decode batch runs num_seqs * n_kv_heads programs; fewer than two per SM
    leaves the GPU idle while each program walks a long context alone. Split until there are about
    2 * num_sms programs, keeping at least _SPLIT_MIN_KEYS keys per slice, at most _MAX_SPLITS.
    Batches of fewer than num_sms / 2 programs (batch 1-8 of a GQA model) split down to one key
    tile (tile_keys: decode_tile_keys) a slice, the last partial tile counted, by a power of
    two at or under 2 * num_sms
    programs (the H200's best: 32 at batch 1, 16 at 2, 8 at 4, 4 at 8).
    """
    programs = max(1, num_seqs * n_kv_heads)
    if 2 * programs <= num_sms:
        by_occupancy = 1 << ((2 * num_sms // programs).bit_length() - 1)
        # every key tile, the last partial one too: by floor, 513-575 keys at batch 1 took 8
        # slices for 9 tiles, and the first slice walked two (decode graphs: the 8-slice
        # graph for half of W1's steps; its attention ran 8.1 us a layer against 5.5 for 16)
        by_length = -(-max_kv_len // tile_keys)
    else:
        by_occupancy = -(-2 * num_sms // programs)
        by_length = max_kv_len // _SPLIT_MIN_KEYS
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def chunk_num_splits(
    query_lens: list[int],
    seq_lens: list[int],
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    num_sms: int,
    max_splits: int,
) -> int:
    """Split-K factor for a step with prompt chunks, from its host-side lengths.

    Only sequences with at least CHUNK_SPLIT_MIN_CONTEXT cached keys before their queries count:
    their programs (query tiles x KV heads) walk long prefixes, the rest are short. When these
    P programs fill less than half the GPU's program slots (SMs x programs an SM holds), each
    is cut into as many slices as still fit in one round of slots, keeping at least
    _CHUNK_SPLIT_MIN_KEYS keys a slice of the longest. More slices than one round lost on the
    H200 (BENCHMARKS.md 2026-11-30 (l): a 384-token chunk, 192 programs for 264 slots, ran
    10-25 % slower with 2 or 4 slices; a 256-token one, 128 programs, 20 % faster with 2).
    """
    if max_splits <= 1 or not query_lens or max(query_lens) <= 1:
        return 1
    group = n_heads // n_kv_heads
    tiles = pick_tiles(max(query_lens), group, head_dim)
    block_q = tiles.block_m // group
    long = [
        (n_q, n)
        for n_q, n in zip(query_lens, seq_lens, strict=True)
        if n_q > 0 and n - n_q >= CHUNK_SPLIT_MIN_CONTEXT
    ]
    if not long:
        return 1
    programs = n_kv_heads * sum(-(-n_q // block_q) for n_q, _ in long)
    by_length = max(n for _, n in long) // _CHUNK_SPLIT_MIN_KEYS
    splits = min(tiles.per_sm * num_sms // programs, max_splits, by_length)
    return splits if splits >= 2 else 1


def chunk_split_limit(n_tokens: int) -> int:
    """The most slices a step with prompt chunks may use: 8, fewer above 512 tokens (the
    workspace holds slices x tokens x n_heads x head_dim float32 values), at least 2."""
    return max(2, min(8, _CHUNK_SPLIT_ROWS // max(n_tokens, 1)))
