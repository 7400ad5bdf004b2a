"""Triton paged attention: one launch for a mixed batch of prefill chunks and decodes.

Same contract as `shared.ops.paged_attention.paged_attention_ref` (and, for an FP8 cache,
`shared.ops.paged_attention_fp8.paged_attention_fp8_ref`): sequence b's queries are rows
query_start_loc[b]:query_start_loc[b + 1] of q and the last of its seq_lens[b] keys, causal, GQA,
optional sliding window. query_start_loc[-1] must equal T and every sequence's block table row must
cover its seq_len keys; both live on the device and are not checked (that would need a host sync).

A program owns one query tile of one sequence and one KV head. Its rows are (token, q head) pairs
of that head's GQA group, so each K/V tile is loaded once for the whole group. It walks the keys in
tiles of TILE_N through the block table with an online softmax, from the first tile the sliding
window can reach to the last the causal mask allows; whole tiles outside are never visited, partial
ones are masked. With split-K the tile range is cut into `num_splits` slices, one per program,
whose partial (max, sum, acc) go to a float32 workspace that a second kernel combines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from shared.kernels.device import interpreted, max_shared_memory
from shared.kernels.device import num_sms as _num_sms  # a module name the tests can patch
from shared.kernels.gdc import launch_kw, pdl
from shared.kernels.paged_attention_jit import (
    _combine_splits_kernel,
    _fp8_e4m3_from_bytes,
    _paged_attention_kernel,
)
from shared.kernels.qmatmul.int8_activations import int8_buffers_for

FP8 = torch.float8_e4m3fn
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
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
    "LONG_DECODE_KEYS",
    "_fp8_e4m3_from_bytes",
    "chunk_num_splits",
    "chunk_split_limit",
    "decode_tile_keys",
    "default_num_splits",
    "paged_attention",
]


@dataclass(frozen=True)
class _Tiles:
    block_m: int  # rows per program: query tokens x the q heads of one KV head
    tile_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int
    per_sm: int = 1  # programs an SM holds at once (registers, shared memory): split-K's slots


def decode_tile_keys(
    head_dim: int, cache_dtype: torch.dtype, max_kv_len: int, device: torch.device | None = None
) -> int:
    """Keys a decode program's tile holds, for contexts of up to max_kv_len keys on device.

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
        and max_shared_memory(device) >= _LONG_TILE_SHARED_MEMORY
    ):
        return 128
    return 64 if head_dim <= 128 else 32


def _pick_tiles(
    max_query_len: int,
    group: int,
    head_dim: int,
    cache_dtype: torch.dtype = torch.bfloat16,
    small_grid: bool = False,
    max_kv_len: int = 0,
    device: torch.device | None = None,
) -> _Tiles:
    """Tiles of a launch. Decode (max_query_len 1): small_grid, the grid has at most two
    programs an SM; max_kv_len and device, the longest context and where (decode_tile_keys)."""
    tile_n = 64 if head_dim <= 128 else 32
    rows = triton.next_power_of_2(group)
    if max_query_len <= 1:  # decode: one token per sequence, its GQA group fills the rows
        keys = decode_tile_keys(head_dim, cache_dtype, max_kv_len, device)
        if keys == 128 and cache_dtype == FP8:
            return _Tiles(max(16, rows), keys, 4, 3)
        if keys == 128:
            # 8 warps won where the grid leaves SMs half empty (batch 1 at 32k: 45.1 against
            # 48.2 us with 4; batch 16: 530 against 566), 4 in full grids (batch 64 over 8k:
            # 504 against 513) (y); FP8 lost with 8 warps everywhere (not explained: its
            # bytes reach the dot's layout through shared memory one at a time)
            return _Tiles(max(16, rows), keys, 8 if small_grid else 4, 2)
        return _Tiles(max(16, rows), keys, 4, 3)
    if head_dim <= 128 and max_query_len <= 512:
        # H200, chunks of 256-512 tokens over 4k-28k prefixes (BENCHMARKS.md 2026-11-30 (l)):
        # 64-row tiles of 4 warps, two a SM, beat 128-row tiles of 8 warps by 12-40 %
        return _Tiles(max(64, rows), tile_n, 4, 2, per_sm=2)
    block_m = 128 if head_dim <= 128 else 64
    return _Tiles(max(block_m, rows), tile_n, 8, 2)


def default_num_splits(
    num_seqs: int, n_kv_heads: int, max_kv_len: int, num_sms: int, tile_keys: int = 64
) -> int:
    """Split-K factor for a decode-only batch.

    Without splitting a decode batch runs num_seqs * n_kv_heads programs; fewer than two per SM
    leaves the GPU idle while each program walks a long context alone. Split until there are about
    2 * num_sms programs, keeping at least _SPLIT_MIN_KEYS keys per slice, at most _MAX_SPLITS.
    Batches of fewer than num_sms / 2 programs (batch 1-8 of a GQA model) split down to one key
    tile (tile_keys: decode_tile_keys) a slice, by a power of two at or under 2 * num_sms
    programs (the H200's best: 32 at batch 1, 16 at 2, 8 at 4, 4 at 8).
    """
    programs = max(1, num_seqs * n_kv_heads)
    if 2 * programs <= num_sms:
        by_occupancy = 1 << ((2 * num_sms // programs).bit_length() - 1)
        by_length = max_kv_len // tile_keys
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
    tiles = _pick_tiles(max(query_lens), group, head_dim)
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


def _native_fp8(device: torch.device) -> bool:
    # tl.float8e4nv needs sm_89+ (the interpreter has it too); elsewhere decode the bytes by hand.
    if device.type != "cuda" or _interpreted():
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


def _interpreted() -> bool:
    return interpreted(_paged_attention_kernel)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(f"paged_attention: {msg}")


def _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, k_scale, v_scale):
    _check(q.dim() == 3, f"q must be [T, n_heads, head_dim], got shape {tuple(q.shape)}")
    _check(q.dtype in _Q_DTYPES, f"q dtype {q.dtype} is not one of {_Q_DTYPES}")
    _check(
        k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
        "k_cache and v_cache must both be [num_blocks, block_size, n_kv_heads, head_dim], got "
        f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}",
    )
    _check(
        k_cache.dtype == v_cache.dtype and k_cache.dtype in _CACHE_DTYPES,
        f"cache dtypes {k_cache.dtype}/{v_cache.dtype}: both must be one of {_CACHE_DTYPES}",
    )
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    n_heads = q.shape[1]
    _check(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _check(head_dim <= _MAX_HEAD_DIM, f"head_dim {head_dim} > {_MAX_HEAD_DIM}")
    _check(
        n_kv_heads > 0 and n_heads % n_kv_heads == 0,
        f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}",
    )
    _check(
        block_size >= 8 and block_size & (block_size - 1) == 0,
        f"block_size {block_size} must be a power of two >= 8",
    )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim, strides {t.stride()}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check(
        block_tables.dim() == 2 and block_tables.dtype == torch.int32,
        f"block_tables must be [B, max_blocks] int32, got {block_tables.dtype} "
        f"{tuple(block_tables.shape)}",
    )
    _check(
        block_tables.stride(1) == 1,
        f"block_tables rows must be contiguous: {block_tables.stride()}",
    )
    _check(
        seq_lens.dim() == 1 and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
        f"seq_lens must be a contiguous [B] int32 tensor, got {seq_lens.dtype} "
        f"{tuple(seq_lens.shape)}",
    )
    _check(
        query_start_loc.dtype == torch.int32
        and query_start_loc.shape == (num_seqs + 1,)
        and query_start_loc.is_contiguous(),
        f"query_start_loc must be a contiguous [B + 1] = [{num_seqs + 1}] int32 tensor, got "
        f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}",
    )
    _check(
        block_tables.shape[0] == num_seqs,
        f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    if k_cache.dtype == FP8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check(s is not None, f"an FP8 cache needs {name}")
            _check(
                s.shape == (num_blocks, block_size, n_kv_heads)
                and s.dtype in (torch.float16, torch.float32),
                f"{name} must be [{num_blocks}, {block_size}, {n_kv_heads}] float16/float32, got "
                f"{s.dtype} {tuple(s.shape)}",
            )
    else:
        _check(
            k_scale is None and v_scale is None,
            f"k_scale/v_scale given for a {k_cache.dtype} cache",
        )
    tensors = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    tensors |= {"query_start_loc": query_start_loc, "seq_lens": seq_lens}
    tensors |= {"k_scale": k_scale, "v_scale": v_scale}
    for name, t in tensors.items():
        if t is not None:
            _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")


def paged_attention(
    q: torch.Tensor,  # [T, n_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, n_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, on q.device
    seq_lens: torch.Tensor,  # [B] int32, on q.device
    scale: float,
    sliding_window: int = 0,
    *,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, n_kv_heads] (FP8 cache)
    v_scale: torch.Tensor | None = None,  # [num_blocks, block_size, n_kv_heads] (FP8 cache)
    num_splits: int = 0,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [T, n_heads, head_dim] in q.dtype
    num_splits_t: torch.Tensor | None = None,  # [1] int32 on q.device, <= num_splits
    int8_layout: tuple[int, int] | None = None,  # (W, G): also return out rounded to int8
) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Attention of q over the paged cache; returns [T, n_heads, head_dim] in q.dtype.

    max_query_len (the longest query run of a sequence) picks the tile shapes; 1 means a decode
    batch. num_splits > 1 forces split-K; 0 lets `default_num_splits` decide for decode batches,
    using max_seq_len (default: the block table's capacity) as the longest context, which also
    picks a decode batch's key tile (decode_tile_keys). With
    num_splits_t, num_splits (> 1) only sizes the launch and the workspace: the kernels read the
    count to use (1 to num_splits, not checked: a host sync) from the device, so a CUDA graph
    can change it between replays. An FP8 cache (float8_e4m3fn, value = fp8 * scale) needs
    k_scale and v_scale and computes in fp16 (float32 for float32 queries).

    With int8_layout (W, G): returns (out, rounded), rounded {(W, G): (xq, xd, xs)} as
    ``int8_activations.prepare_int8`` makes them of out's row for a weight of that layout, when
    the combine pass rounded it (one token, a split count > 1 not read from the device, heads of
    whole sub-blocks; it then saves the next GEMV its rounding launch), else {}.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, k_scale, v_scale)
    n_tokens, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check(0 <= max_query_len <= n_tokens, f"max_query_len {max_query_len} not in [0, {n_tokens}]")
    _check(sliding_window >= 0, f"sliding_window {sliding_window} < 0")
    _check(num_splits >= 0, f"num_splits {num_splits} < 0")
    if num_splits_t is not None:
        _check(num_splits > 1, f"num_splits_t needs num_splits > 1 (the most), got {num_splits}")
        _check(
            num_splits_t.shape == (1,)
            and num_splits_t.dtype == torch.int32
            and num_splits_t.device == q.device,
            f"num_splits_t must be a [1] int32 tensor on {q.device}, got {num_splits_t.dtype} "
            f"{tuple(num_splits_t.shape)} on {num_splits_t.device}",
        )
    if out is None:
        out = torch.empty_like(q)
    _check(
        out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
        f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}",
    )
    _check(out.stride(-1) == 1, f"out must be contiguous in head_dim, strides {out.stride()}")
    if n_tokens == 0 or num_seqs == 0:
        return out if int8_layout is None else (out, {})

    group = n_heads // n_kv_heads
    sms = _num_sms(q.device)
    max_kv_len = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    if sliding_window:
        max_kv_len = min(max_kv_len, sliding_window)
    if num_splits == 0:
        num_splits = 1
        if max_query_len == 1:
            tile_keys = decode_tile_keys(head_dim, k_cache.dtype, max_kv_len, q.device)
            num_splits = default_num_splits(num_seqs, n_kv_heads, max_kv_len, sms, tile_keys)
    small_grid = num_seqs * n_kv_heads * num_splits <= 2 * sms
    tiles = _pick_tiles(
        max_query_len, group, head_dim, k_cache.dtype, small_grid, max_kv_len, q.device
    )

    kv_fp8 = k_cache.dtype == FP8
    fp8_from_bytes = kv_fp8 and not _native_fp8(q.device)
    if fp8_from_bytes:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    compute_dtype = q.dtype if kv_fp8 else k_cache.dtype
    ks = k_scale if kv_fp8 else k_cache  # a pointer the kernel never reads without FP8
    vs = v_scale if kv_fp8 else v_cache
    ks_strides = k_scale.stride() if kv_fp8 else (0, 0, 0)
    vs_strides = v_scale.stride() if kv_fp8 else (0, 0, 0)

    if num_splits > 1:
        part_acc = torch.empty(
            (num_splits, n_tokens, n_heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            (2, num_splits, n_tokens, n_heads), dtype=torch.float32, device=q.device
        )
        part_m, part_l = part_ml[0], part_ml[1]
    else:
        part_acc, part_m, part_l = out, out, out  # unused
    dynamic = num_splits_t is not None
    splits_t = num_splits_t if dynamic else seq_lens  # a pointer never read without DYNAMIC
    block_q = tiles.block_m // group
    grid = (n_tokens // block_q + num_seqs, n_kv_heads, num_splits)
    early = pdl(q.device, _paged_attention_kernel)
    _paged_attention_kernel[grid](
        out, part_acc, part_m, part_l,
        q, k_cache, v_cache, ks, vs,
        block_tables, query_start_loc, seq_lens,
        num_seqs, num_splits, splits_t, sliding_window, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *ks_strides, *vs_strides,
        block_tables.stride(0),
        *part_acc.stride()[:3], *part_m.stride()[:3],
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        BLOCK_M=tiles.block_m,
        BLOCK_Q=block_q,
        TILE_N=tiles.tile_n,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window > 0,
        USE_SPLITS=num_splits > 1,
        DYNAMIC_SPLITS=dynamic,
        KV_FP8=kv_fp8,
        FP8_FROM_BYTES=fp8_from_bytes,
        DOT_PRECISION="ieee" if compute_dtype == torch.float32 else "tf32",
        INTERPRETED=_interpreted(),
        PDL=early,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **launch_kw(early),
    )  # fmt: skip
    rounded = {}
    if num_splits > 1:
        w, g = int8_layout or (32, 8)  # (any layout: the kernel rounds nothing without ROUND)
        if int8_layout and not dynamic and n_tokens == 1 and _rounds_heads(head_dim, w):
            rounded = {int8_layout: int8_buffers_for(n_heads * head_dim, w, g, q.device)}
        bufs = rounded[int8_layout] if rounded else (out,) * 3
        _combine_splits_kernel[(n_tokens, n_heads)](
            out, part_acc, part_m, part_l, num_splits, splits_t,
            out.stride(0), out.stride(1), *part_acc.stride()[:3], *part_m.stride()[:3], *bufs,
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            SPLITS=triton.next_power_of_2(num_splits),
            DYNAMIC_SPLITS=dynamic,
            INTERPRETED=_interpreted(),
            PDL=early,
            ROUND=bool(rounded),
            W=w,
            G=g,
            **launch_kw(early),
        )  # fmt: skip
    return out if int8_layout is None else (out, rounded)


def _rounds_heads(head_dim: int, w: int) -> bool:
    """Whether the combine pass can round a head's outputs by itself: whole sub-blocks of w
    in a power-of-two head."""
    return head_dim % w == 0 and head_dim == triton.next_power_of_2(head_dim)
