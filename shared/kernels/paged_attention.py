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
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FP8 = torch.float8_e4m3fn
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
# Split-K: a slice shorter than this many keys costs more in the combine pass than it wins.
_SPLIT_MIN_KEYS = 2048  # H200: shorter slices lost to the combine pass (B=16, 1k ctx: 140 vs 63 us)
_MAX_SPLITS = 16


@triton.jit
def _find_seq(query_start_loc_ptr, q_tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence b owns programs [start(b), start(b + 1)) with start(b) = qsl[b] // BLOCK_Q + b: at
    # least cdiv(n_query, BLOCK_Q) of them, strictly increasing even for sequences with no query.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _fp8_e4m3_from_bytes(x):
    # e4m3fn -> float32 without fp8 hardware (before sm_89): put sign, exponent and mantissa into
    # an fp16 bit pattern (exponent bias 15 instead of 7, subnormals included) and rescale by 2^8.
    # The NaN pattern 0x7f decodes to 480; the quantizer never writes it.
    x = x.to(tl.uint16)
    bits = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _load_kv(ptrs, mask, KV_FP8: tl.constexpr, FP8_FROM_BYTES: tl.constexpr):
    if KV_FP8:  # `other` cannot be cast to fp8: zero the masked lanes after decoding
        x = tl.load(ptrs, mask=mask)
        x = _fp8_e4m3_from_bytes(x) if FP8_FROM_BYTES else x.to(tl.float32)
        x = tl.where(mask, x, 0.0)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED and x.dtype == tl.float32 and dtype == tl.bfloat16:
        # The interpreter truncates float32 -> bfloat16; round to nearest even as the GPU does.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED and a.dtype == tl.bfloat16:  # it would multiply bf16 bit patterns as uint16
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, BLOCK_D] in the compute dtype
    m_i,  # [BLOCK_M] float32: running max of the scores (log2 units)
    l_i,  # [BLOCK_M] float32: running sum of exp2(score - m_i)
    acc,  # [BLOCK_M, BLOCK_D] float32: running sum of p @ V
    tile,
    q_pos,  # [BLOCK_M] position of each row's query in its sequence
    seq_len,
    sliding_window,
    qk_scale,
    table_ptr,  # [max_blocks] int32: this sequence's row of the block table
    k_ptr,  # [num_blocks, block_size, head_dim] at this KV head
    v_ptr,  # [num_blocks, block_size, head_dim] at this KV head
    k_scale_ptr,  # [num_blocks, block_size] at this KV head (FP8 only)
    v_scale_ptr,  # [num_blocks, block_size] at this KV head (FP8 only)
    stride_k_b: tl.int64,
    stride_k_t: tl.int64,
    stride_v_b: tl.int64,
    stride_v_t: tl.int64,
    stride_ks_b: tl.int64,
    stride_ks_t: tl.int64,
    stride_vs_b: tl.int64,
    stride_vs_t: tl.int64,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_FROM_BYTES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    key = tile * TILE_N + tl.arange(0, TILE_N)
    key_ok = key < seq_len  # slots past the end may hold anything, NaN included: never load them
    block = tl.load(table_ptr + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = key % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    k_off = block[None, :] * stride_k_b + slot[None, :] * stride_k_t + d[:, None]
    k = _load_kv(k_ptr + k_off, d_ok[:, None] & key_ok[None, :], KV_FP8, FP8_FROM_BYTES)
    # FP8 values are exact in fp16/bf16, so K's per-token scale is applied to the scores instead.
    s = _dot(q, k.to(q.dtype), None, DOT_PRECISION, INTERPRETED)  # [BLOCK_M, TILE_N]
    if KV_FP8:
        ks = tl.load(k_scale_ptr + block * stride_ks_b + slot * stride_ks_t, mask=key_ok, other=0)
        s = s * (ks.to(tl.float32) * qk_scale)[None, :]
    else:
        s = s * qk_scale
    visible = key[None, :] <= q_pos[:, None]  # also hides keys past seq_len and padding rows
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - key[None, :] < sliding_window)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v_off = block[:, None] * stride_v_b + slot[:, None] * stride_v_t + d[None, :]
    v = _load_kv(v_ptr + v_off, key_ok[:, None] & d_ok[None, :], KV_FP8, FP8_FROM_BYTES)
    if KV_FP8:
        vs = tl.load(v_scale_ptr + block * stride_vs_b + slot * stride_vs_t, mask=key_ok, other=0)
        v = v * vs.to(tl.float32)[:, None]
    p = _cast(p, q.dtype, INTERPRETED)
    v = _cast(v, q.dtype, INTERPRETED)
    acc = _dot(p, v, acc * alpha[:, None], DOT_PRECISION, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, n_heads, head_dim] (not written with split-K)
    part_acc_ptr,  # [num_splits, T, n_heads, head_dim] float32 (split-K only)
    part_m_ptr,  # [num_splits, T, n_heads] float32: max score, log2 units (split-K only)
    part_l_ptr,  # [num_splits, T, n_heads] float32: softmax denominator (split-K only)
    q_ptr,  # [T, n_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, n_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, n_kv_heads, head_dim]
    k_scale_ptr,  # [num_blocks, block_size, n_kv_heads] (FP8 only)
    v_scale_ptr,  # [num_blocks, block_size, n_kv_heads] (FP8 only)
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    num_seqs,
    num_splits,
    sliding_window,
    qk_scale,  # softmax scale * log2(e)
    stride_q_t: tl.int64,
    stride_q_h: tl.int64,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_k_b: tl.int64,
    stride_k_t: tl.int64,
    stride_k_h: tl.int64,
    stride_v_b: tl.int64,
    stride_v_t: tl.int64,
    stride_v_h: tl.int64,
    stride_ks_b: tl.int64,
    stride_ks_t: tl.int64,
    stride_ks_h: tl.int64,
    stride_vs_b: tl.int64,
    stride_vs_t: tl.int64,
    stride_vs_h: tl.int64,
    stride_bt_b: tl.int64,
    stride_pa_s: tl.int64,
    stride_pa_t: tl.int64,
    stride_pa_h: tl.int64,
    stride_pm_s: tl.int64,
    stride_pm_t: tl.int64,
    stride_pm_h: tl.int64,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    GROUP: tl.constexpr,  # q heads per KV head
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SPLITS: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_FROM_BYTES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET=1 on the CPU: work around its gaps
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    n_query = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile = tl.program_id(0) - (q_begin // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= n_query:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - n_query

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < n_query)
    q_pos = tl.where(row_ok, context + q_idx, -1)  # -1: a padding row sees no key
    token = (q_begin + q_idx).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_off = token[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0)
    # operands in the cache dtype, like the reference; an FP8 cache is dequantized to q's dtype
    q = _cast(q, q_ptr.dtype.element_ty if KV_FP8 else k_cache_ptr.dtype.element_ty, INTERPRETED)

    # Key tiles this query tile can see: causal up to its last token, window from its first.
    first_pos = context + q_tile * BLOCK_Q
    last_pos = context + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, n_query) - 1
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(first_pos - sliding_window + 1, 0) // TILE_N
    tile_hi = tl.cdiv(last_pos + 1, TILE_N)
    if USE_SPLITS:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    k_ptr = k_cache_ptr + kv_head * stride_k_h
    v_ptr = v_cache_ptr + kv_head * stride_v_h
    ks_ptr = k_scale_ptr + kv_head * stride_ks_h
    vs_ptr = v_scale_ptr + kv_head * stride_vs_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if INTERPRETED:
        # The interpreter cannot range() over tensor bounds with numpy >= 2.4 (triton#9171).
        tile = tile_lo
        while tile < tile_hi:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, seq_len, sliding_window, qk_scale,
                table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                stride_k_b, stride_k_t, stride_v_b, stride_v_t,
                stride_ks_b, stride_ks_t, stride_vs_b, stride_vs_t,
                HEAD_DIM, BLOCK_D, TILE_N, BLOCK_SIZE, USE_WINDOW, KV_FP8, FP8_FROM_BYTES,
                DOT_PRECISION, INTERPRETED,
            )  # fmt: skip
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, seq_len, sliding_window, qk_scale,
                table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                stride_k_b, stride_k_t, stride_v_b, stride_v_t,
                stride_ks_b, stride_ks_t, stride_vs_b, stride_vs_t,
                HEAD_DIM, BLOCK_D, TILE_N, BLOCK_SIZE, USE_WINDOW, KV_FP8, FP8_FROM_BYTES,
                DOT_PRECISION, INTERPRETED,
            )  # fmt: skip

    if USE_SPLITS:
        pa_off = split * stride_pa_s + token[:, None] * stride_pa_t + head[:, None] * stride_pa_h
        tl.store(part_acc_ptr + pa_off + d[None, :], acc, mask=io_mask)
        pm_off = split * stride_pm_s + token * stride_pm_t + head * stride_pm_h
        tl.store(part_m_ptr + pm_off, m_i, mask=row_ok)
        tl.store(part_l_ptr + pm_off, l_i, mask=row_ok)
    else:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        o_off = token[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
        tl.store(out_ptr + o_off, _cast(o, out_ptr.dtype.element_ty, INTERPRETED), mask=io_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, n_heads, head_dim]
    part_acc_ptr,  # [num_splits, T, n_heads, head_dim] float32
    part_m_ptr,  # [num_splits, T, n_heads] float32
    part_l_ptr,  # [num_splits, T, n_heads] float32
    num_splits,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_pa_s: tl.int64,
    stride_pa_t: tl.int64,
    stride_pa_h: tl.int64,
    stride_pm_s: tl.int64,
    stride_pm_t: tl.int64,
    stride_pm_h: tl.int64,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pm_off = s * stride_pm_s + token * stride_pm_t + head * stride_pm_h
    m = tl.load(part_m_ptr + pm_off, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + pm_off, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty slices weigh 0
    pa_off = s[:, None] * stride_pa_s + token * stride_pa_t + head * stride_pa_h + d[None, :]
    acc = tl.load(part_acc_ptr + pa_off, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    o = _cast(o, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + d, o, mask=d_ok)


@dataclass(frozen=True)
class _Tiles:
    block_m: int  # rows per program: query tokens x the q heads of one KV head
    tile_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


def _pick_tiles(max_query_len: int, group: int, head_dim: int) -> _Tiles:
    tile_n = 64 if head_dim <= 128 else 32
    if max_query_len <= 1:  # decode: one token per sequence, its GQA group fills the rows
        return _Tiles(max(16, triton.next_power_of_2(group)), tile_n, 4, 3)
    block_m = 128 if head_dim <= 128 else 64
    return _Tiles(max(block_m, triton.next_power_of_2(group)), tile_n, 8, 2)


def default_num_splits(num_seqs: int, n_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Split-K factor for a decode-only batch.

    Without splitting a decode batch runs num_seqs * n_kv_heads programs; fewer than two per SM
    leaves the GPU idle while each program walks a long context alone. Split until there are about
    2 * num_sms programs, keeping at least _SPLIT_MIN_KEYS keys per slice, at most _MAX_SPLITS.
    """
    by_occupancy = -(-2 * num_sms // max(1, num_seqs * n_kv_heads))
    by_length = max_kv_len // _SPLIT_MIN_KEYS
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def _native_fp8(device: torch.device) -> bool:
    # tl.float8e4nv needs sm_89+ (the interpreter has it too); elsewhere decode the bytes by hand.
    if device.type != "cuda" or _interpreted():
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


def _interpreted() -> bool:
    # Whether @triton.jit built interpreter functions (TRITON_INTERPRET=1 when triton was imported).
    return isinstance(_paged_attention_kernel, InterpretedFunction)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


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
) -> torch.Tensor:
    """Attention of q over the paged cache; returns [T, n_heads, head_dim] in q.dtype.

    max_query_len (the longest query run of a sequence) picks the tile shapes; 1 means a decode
    batch. num_splits > 1 forces split-K; 0 lets `default_num_splits` decide for decode batches,
    using max_seq_len (default: the block table's capacity) as the longest context. An FP8 cache
    (float8_e4m3fn, value = fp8 * scale) needs k_scale and v_scale and computes in q.dtype.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, k_scale, v_scale)
    n_tokens, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check(0 <= max_query_len <= n_tokens, f"max_query_len {max_query_len} not in [0, {n_tokens}]")
    _check(sliding_window >= 0, f"sliding_window {sliding_window} < 0")
    _check(num_splits >= 0, f"num_splits {num_splits} < 0")
    if out is None:
        out = torch.empty_like(q)
    _check(
        out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
        f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}",
    )
    _check(out.stride(-1) == 1, f"out must be contiguous in head_dim, strides {out.stride()}")
    if n_tokens == 0 or num_seqs == 0:
        return out

    group = n_heads // n_kv_heads
    tiles = _pick_tiles(max_query_len, group, head_dim)
    if num_splits == 0:
        num_splits = 1
        if max_query_len == 1:
            max_kv_len = (
                max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
            )
            if sliding_window:
                max_kv_len = min(max_kv_len, sliding_window)
            num_splits = default_num_splits(num_seqs, n_kv_heads, max_kv_len, _num_sms(q.device))

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
    block_q = tiles.block_m // group
    grid = (n_tokens // block_q + num_seqs, n_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_m, part_l,
        q, k_cache, v_cache, ks, vs,
        block_tables, query_start_loc, seq_lens,
        num_seqs, num_splits, sliding_window, scale * math.log2(math.e),
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
        KV_FP8=kv_fp8,
        FP8_FROM_BYTES=fp8_from_bytes,
        DOT_PRECISION="ieee" if compute_dtype == torch.float32 else "tf32",
        INTERPRETED=_interpreted(),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(n_tokens, n_heads)](
            out, part_acc, part_m, part_l, num_splits,
            out.stride(0), out.stride(1), *part_acc.stride()[:3], *part_m.stride()[:3],
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            SPLITS=triton.next_power_of_2(num_splits),
            INTERPRETED=_interpreted(),
        )  # fmt: skip
    return out
