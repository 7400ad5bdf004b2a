"""The Triton programs behind `shared.kernels.paged_attention` (see its docstring for the
contract and the design); the wrapper there checks inputs, picks tiles and launches these. The
split-K combine pass is `paged_attention_combine`."""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.gdc import launch_next, wait_prev
from shared.kernels.rounding import FP16_MAX, fp16_range, to_dtype

# per-token FP8 scales: the probabilities are multiplied by V's scale times this (see _attend_tile)
V_LIFT = tl.constexpr(256.0)


@triton.jit
def _find_seq(query_start_loc_ptr, q_tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence b owns programs [start(b), start(b + 1)) with start(b) = qsl[b] // BLOCK_Q + b: at
    # least cdiv(n_query, BLOCK_Q) of them, strictly increasing even for sequences with no query.
    # A batch of one sequence is found without the search's load: the loads that need it start
    # one memory round trip sooner (H200, W1 Q4_K_M: +0.3 to +0.8 %, BENCHMARKS.md 2026-12-02
    # (al)).
    lo: tl.int32 = 0
    hi = num_seqs
    if num_seqs == 1:
        lo = 1
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
def _load_kv(ptrs, mask, KV_FP8: tl.constexpr, FP8_FROM_BYTES: tl.constexpr, DTYPE: tl.constexpr):
    """K or V values in DTYPE (the dot's; FP8 values are exact in fp16/bf16), 0 where masked."""
    if FP8_FROM_BYTES:  # `other` cannot be cast to fp8: zero the masked lanes after decoding
        x = tl.load(ptrs, mask=mask)
        x = tl.where(mask, _fp8_e4m3_from_bytes(x), 0.0).to(DTYPE)
    elif KV_FP8:  # the byte 0 is +0.0 in e4m3: load bytes with 0 as `other`, convert once
        raw = tl.load(ptrs.to(tl.pointer_type(tl.uint8)), mask=mask, other=0)
        x = raw.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


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
    TOKEN_SCALES: tl.constexpr,  # FP8 with a scale per token (else per KV head: applied outside)
    FP8_FROM_BYTES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PRE: tl.constexpr = False,  # the tile's blocks, and K and V below lo_key, loaded already
    pre_block=0,  # [TILE_N] int64
    pre_k=0,  # [BLOCK_D, TILE_N] in the cache dtype, zero from lo_key on
    pre_v=0,  # [TILE_N, BLOCK_D]
    lo_key=0,
):
    key = tile * TILE_N + tl.arange(0, TILE_N)
    key_ok = key < seq_len  # slots past the end may hold anything, NaN included: never load them
    if PRE:
        block = pre_block
        fresh = key_ok & (key >= lo_key)  # only the keys this step wrote are loaded here
    else:
        block = tl.load(table_ptr + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        fresh = key_ok
    slot = key % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    k_off = block[None, :] * stride_k_b + slot[None, :] * stride_k_t + d[:, None]
    k = _load_kv(k_ptr + k_off, d_ok[:, None] & fresh[None, :], KV_FP8, FP8_FROM_BYTES, q.dtype)
    v_off = block[:, None] * stride_v_b + slot[:, None] * stride_v_t + d[None, :]
    if PRE:  # the step's own values too, before the dot: one memory round trip, not two
        k = tl.where(fresh[None, :], k, pre_k)
        v = _load_kv(v_ptr + v_off, fresh[:, None] & d_ok[None, :], KV_FP8, FP8_FROM_BYTES, q.dtype)
        v = tl.where(fresh[:, None], v, pre_v)
    # FP8 values are exact in fp16/bf16, so K's per-token scale is applied to the scores instead.
    s = _dot(q, k, None, DOT_PRECISION, INTERPRETED)  # [BLOCK_M, TILE_N]
    if TOKEN_SCALES:
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

    if not PRE:
        v_ok = key_ok[:, None] & d_ok[None, :]
        v = _load_kv(v_ptr + v_off, v_ok, KV_FP8, FP8_FROM_BYTES, q.dtype)
    if TOKEN_SCALES:
        # V's per-token scale goes into the probabilities, p @ (v * s) = (p * s) @ v: one
        # multiply a score and one rounding, where scaling V took a multiply, a clamp and two
        # conversions a value and rounded twice. V_LIFT (a power of two, divided out of the sums
        # once a program) keeps p * s, s = amax / 448, inside fp16's normal range.
        vs = tl.load(v_scale_ptr + block * stride_vs_b + slot * stride_vs_t, mask=key_ok, other=0)
        p = p * tl.minimum(vs.to(tl.float32) * V_LIFT, FP16_MAX)[None, :]  # p <= 1: in range
    p = to_dtype(p, q.dtype, INTERPRETED)
    v = to_dtype(v, q.dtype, INTERPRETED)
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
    num_splits,  # the grid's split dimension (and the workspace's)
    splits_ptr,  # [1] int32: the slices to use, <= num_splits (DYNAMIC_SPLITS only)
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
    DYNAMIC_SPLITS: tl.constexpr,  # the split count is read from splits_ptr (CUDA graphs)
    KV_FP8: tl.constexpr,
    HEAD_SCALES: tl.constexpr,  # FP8 with one scale per KV head (block and slot strides 0)
    FP8_FROM_BYTES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,  # TRITON_INTERPRET=1 on the CPU: work around its gaps
    PDL: tl.constexpr,  # launched early (shared.kernels.gdc)
    PREFETCH: tl.constexpr = False,  # 16-bit cache: the first tile's old keys before wait_prev
):
    launch_next(PDL)
    n_splits = num_splits
    if DYNAMIC_SPLITS:
        # set before the step's kernels (a graph's input), never by one of them: it is read
        # while the previous kernel ends, not one memory round trip after it
        n_splits = tl.load(splits_ptr)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # where the program's queries are, while the previous kernel ends: query_start_loc and
    # seq_lens are the step's inputs, set before its first kernel (as splits_ptr), not by one
    # of the kernels launched early before this one; q and the cache come after the wait
    seq = _find_seq(query_start_loc_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    n_query = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_tile = tl.program_id(0) - (q_begin // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - n_query
    # Key tiles this query tile can see: causal up to its last token, window from its first.
    first_pos = context + q_tile * BLOCK_Q
    last_pos = context + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, n_query) - 1
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(first_pos - sliding_window + 1, 0) // TILE_N
    tile_hi = tl.cdiv(last_pos + 1, TILE_N)
    if USE_SPLITS:
        per_split = tl.cdiv(tile_hi - tile_lo, n_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    k_ptr = k_cache_ptr + kv_head * stride_k_h
    v_ptr = v_cache_ptr + kv_head * stride_v_h
    d = tl.arange(0, BLOCK_D)
    pre_block, pre_k, pre_v = 0, 0, 0
    if PREFETCH:  # keys before `context` were written by earlier steps: stable while we wait
        pkey = tile_lo * TILE_N + tl.arange(0, TILE_N)
        live = (split < n_splits) & (q_tile * BLOCK_Q < n_query) & (tile_lo < tile_hi)
        pkey_ok = (pkey < seq_len) & live
        pre_block = tl.load(table_ptr + pkey // BLOCK_SIZE, mask=pkey_ok, other=0).to(tl.int64)
        pslot = pkey % BLOCK_SIZE
        old = pkey_ok & (pkey < context)
        d_ok = d < HEAD_DIM
        pk_off = pre_block[None, :] * stride_k_b + pslot[None, :] * stride_k_t + d[:, None]
        pre_k = tl.load(k_ptr + pk_off, mask=d_ok[:, None] & old[None, :], other=0.0)
        pv_off = pre_block[:, None] * stride_v_b + pslot[:, None] * stride_v_t + d[None, :]
        pre_v = tl.load(v_ptr + pv_off, mask=old[:, None] & d_ok[None, :], other=0.0)
    wait_prev(PDL)  # before any return: finishing must imply the previous kernel finished
    if split >= n_splits:
        return
    if q_tile * BLOCK_Q >= n_query:
        return

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < n_query)
    q_pos = tl.where(row_ok, context + q_idx, -1)  # -1: a padding row sees no key
    token = (q_begin + q_idx).to(tl.int64)
    io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_off = token[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0)
    # operands in the cache dtype, like the reference. An FP8 cache's values are exact in fp16,
    # which one instruction forms from a pair of them (bf16 takes a float32 detour, twice the
    # loop's conversions): 16-bit queries compute in fp16, clamped to its range, which keeps
    # more of q's and the probabilities' bits than bf16; float32 queries stay float32.
    if KV_FP8:
        if q_ptr.dtype.element_ty == tl.float32:
            q = q.to(tl.float32)
        else:
            q = fp16_range(q.to(tl.float32)).to(tl.float16)
    else:
        q = to_dtype(q, k_cache_ptr.dtype.element_ty, INTERPRETED)

    ks_ptr = k_scale_ptr + kv_head * stride_ks_h
    vs_ptr = v_scale_ptr + kv_head * stride_vs_h
    if HEAD_SCALES:  # K's scale joins the softmax scale; V's multiplies the sums at the end
        qk_scale = qk_scale * tl.load(ks_ptr).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if PREFETCH:  # the first tile from what came before the wait, and the step's own keys
        if tile_lo < tile_hi:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile_lo, q_pos, seq_len, sliding_window, qk_scale,
                table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                stride_k_b, stride_k_t, stride_v_b, stride_v_t,
                stride_ks_b, stride_ks_t, stride_vs_b, stride_vs_t,
                HEAD_DIM, BLOCK_D, TILE_N, BLOCK_SIZE, USE_WINDOW, KV_FP8,
                KV_FP8 and not HEAD_SCALES, FP8_FROM_BYTES, DOT_PRECISION, INTERPRETED,
                True, pre_block, pre_k, pre_v, context,
            )  # fmt: skip
        tile_lo += 1
    if INTERPRETED:
        # The interpreter cannot range() over tensor bounds with numpy >= 2.4 (triton#9171).
        tile = tile_lo
        while tile < tile_hi:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, seq_len, sliding_window, qk_scale,
                table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                stride_k_b, stride_k_t, stride_v_b, stride_v_t,
                stride_ks_b, stride_ks_t, stride_vs_b, stride_vs_t,
                HEAD_DIM, BLOCK_D, TILE_N, BLOCK_SIZE, USE_WINDOW, KV_FP8,
                KV_FP8 and not HEAD_SCALES, FP8_FROM_BYTES, DOT_PRECISION, INTERPRETED,
            )  # fmt: skip
            tile += 1
    else:
        for tile in range(tile_lo, tile_hi):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile, q_pos, seq_len, sliding_window, qk_scale,
                table_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr,
                stride_k_b, stride_k_t, stride_v_b, stride_v_t,
                stride_ks_b, stride_ks_t, stride_vs_b, stride_vs_t,
                HEAD_DIM, BLOCK_D, TILE_N, BLOCK_SIZE, USE_WINDOW, KV_FP8,
                KV_FP8 and not HEAD_SCALES, FP8_FROM_BYTES, DOT_PRECISION, INTERPRETED,
            )  # fmt: skip

    if HEAD_SCALES:
        acc = acc * tl.load(vs_ptr).to(tl.float32)
    elif KV_FP8:
        acc = acc * (1.0 / V_LIFT)  # exact: a power of two
    # one slice (no split-K, or a dynamic count of 1): the result goes straight to out
    to_parts = False
    if USE_SPLITS:
        to_parts = n_splits > 1
    if to_parts:
        pa_off = split * stride_pa_s + token[:, None] * stride_pa_t + head[:, None] * stride_pa_h
        tl.store(part_acc_ptr + pa_off + d[None, :], acc, mask=io_mask)
        pm_off = split * stride_pm_s + token * stride_pm_t + head * stride_pm_h
        tl.store(part_m_ptr + pm_off, m_i, mask=row_ok)
        tl.store(part_l_ptr + pm_off, l_i, mask=row_ok)
    else:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        o_off = token[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :]
        tl.store(out_ptr + o_off, to_dtype(o, out_ptr.dtype.element_ty, INTERPRETED), mask=io_mask)
