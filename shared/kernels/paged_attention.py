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

import torch
import triton

from shared.kernels.attention_plan import (
    CHUNK_SPLIT_MIN_CONTEXT,
    FP8,
    LONG_DECODE_KEYS,
    chunk_num_splits,
    chunk_split_limit,
    decode_tile_keys,
    default_num_splits,
)
from shared.kernels.attention_plan import Tiles as _Tiles  # noqa: F401 - tests build tiles
from shared.kernels.attention_plan import pick_tiles as _pick_tiles  # a name tests patch
from shared.kernels.device import interpreted, max_shared_memory
from shared.kernels.device import num_sms as _num_sms  # a module name the tests can patch
from shared.kernels.gdc import launch_kw, pdl
from shared.kernels.paged_attention_combine import _combine_splits_kernel
from shared.kernels.paged_attention_jit import _fp8_e4m3_from_bytes, _paged_attention_kernel
from shared.kernels.qmatmul.int8_activations import int8_buffers_for
from shared.ops.paged_attention_fp8 import fixed_scales

_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
__all__ = [
    "CHUNK_SPLIT_MIN_CONTEXT",
    "FP8",
    "LONG_DECODE_KEYS",
    "_fp8_e4m3_from_bytes",
    "chunk_num_splits",
    "chunk_split_limit",
    "decode_tile_keys",
    "default_num_splits",
    "paged_attention",
]

# warps of a combine program (one head): with 1 a thread holds every slice of its dimensions
# (the sum over slices needs no barrier nor shared memory). H200, W1 (BENCHMARKS.md
# 2026-12-03 (ar)), against Triton's default 4: Q4_K_M +1.0 / +1.0 %, Q6_K +1.1 %, Q8_0 +1.4 %;
# 2 warps lost (-1.0 / -0.8 %)
_COMBINE_WARPS = 1


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
    k_scale and v_scale and computes in fp16 (float32 for float32 queries); scales with block
    and slot strides 0 (one per KV head) are applied once a program instead of once a key.

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
    smem = max_shared_memory(q.device) if max_query_len <= 1 else 0  # decode tiles only
    if num_splits == 0:
        num_splits = 1
        if max_query_len == 1:
            tile_keys = decode_tile_keys(head_dim, k_cache.dtype, max_kv_len, smem, num_seqs)
            num_splits = default_num_splits(num_seqs, n_kv_heads, max_kv_len, sms, tile_keys)
    small_grid = num_seqs * n_kv_heads * num_splits <= 2 * sms
    tiles = _pick_tiles(
        max_query_len, group, head_dim, k_cache.dtype, small_grid, max_kv_len, smem, num_seqs
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
    # one scale per KV head (KVPool(scales="head")): applied once a program, not once a key
    head_scales = kv_fp8 and fixed_scales(k_scale) and fixed_scales(v_scale)

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
        HEAD_SCALES=head_scales,
        FP8_FROM_BYTES=fp8_from_bytes,
        DOT_PRECISION="ieee" if compute_dtype == torch.float32 else "tf32",
        INTERPRETED=_interpreted(),
        PDL=early,
        # decode with 64-key tiles of a 16-bit cache: a program loads its first tile's blocks
        # and the keys and values of earlier steps before wait_prev (gdc), and only the step's
        # own key after it
        PREFETCH=max_query_len <= 1 and tiles.tile_n <= 64 and not kv_fp8,
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
            num_warps=_COMBINE_WARPS,
            **launch_kw(early),
        )  # fmt: skip
    return out if int8_layout is None else (out, rounded)


def _rounds_heads(head_dim: int, w: int) -> bool:
    """Whether the combine pass can round a head's outputs by itself: whole sub-blocks of w
    in a power-of-two head."""
    return head_dim % w == 0 and head_dim == triton.next_power_of_2(head_dim)
