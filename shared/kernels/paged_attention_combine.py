"""The split-K paged attention's combine (``paged_attention_jit``): each head's slices,
weighted by their maxima, summed into the output row, and with ROUND rounded to int8 for the
next GEMV. Either a launch of its own after the attention (``_combine_splits_kernel``) or, in
decode launches given ticket counters, the attention's last slice of a sequence's KV head
combining that head's GQA group (``fold_splits``): one kernel boundary a layer fewer.
``shared.kernels.paged_attention`` chooses and launches."""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels import probe
from shared.kernels.gdc import launch_next, wait_prev
from shared.kernels.qmatmul.int8_activations import round_blocks
from shared.kernels.rounding import to_dtype


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, n_heads, head_dim]
    part_acc_ptr,  # [num_splits, T, n_heads, head_dim] float32
    part_m_ptr,  # [num_splits, T, n_heads] float32
    part_l_ptr,  # [num_splits, T, n_heads] float32
    num_splits,
    splits_ptr,  # [1] int32: the slices used (DYNAMIC_SPLITS only); 1 = out is written already
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_pa_s: tl.int64,
    stride_pa_t: tl.int64,
    stride_pa_h: tl.int64,
    stride_pm_s: tl.int64,
    stride_pm_t: tl.int64,
    stride_pm_h: tl.int64,
    xq_ptr,
    xd_ptr,
    xs_ptr,  # the (single) token's output rounded to int8 in layout (W, G) (ROUND)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    DYNAMIC_SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PDL: tl.constexpr,  # launched early (shared.kernels.gdc)
    ROUND: tl.constexpr = False,  # one token, BLOCK_D = HEAD_DIM, a multiple of W
    W: tl.constexpr = 32,
    G: tl.constexpr = 8,
    PROBE: tl.constexpr = False,  # a record a program in probe_ptr (shared.kernels.probe)
    probe_ptr=None,
):
    if PROBE:
        g0, c0 = probe.now(0)
    launch_next(PDL)
    n_splits = num_splits
    if DYNAMIC_SPLITS:
        n_splits = tl.load(splits_ptr)  # before the wait, as the attention kernel's
    wait_prev(PDL)  # before the early return, as the attention kernel's
    if PROBE:
        g1, c1 = probe.now(0)
        if n_splits == 1:
            _probe_record(probe_ptr, g0, g1, g1, c0, c1, c1, n_splits)
    if n_splits == 1:
        return
    o = combine_head(
        out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, n_splits, tl.program_id(0).to(tl.int64),
        tl.program_id(1), stride_o_t, stride_o_h, stride_pa_s, stride_pa_t, stride_pa_h,
        stride_pm_s, stride_pm_t, stride_pm_h, xq_ptr, xd_ptr, xs_ptr,
        HEAD_DIM, BLOCK_D, SPLITS, INTERPRETED, ROUND, W, G,
    )  # fmt: skip
    if PROBE:
        g3, c3 = probe.now(tl.sum(o.to(tl.float32), 0).to(tl.int32, bitcast=True))
        _probe_record(probe_ptr, g0, g1, g3, c0, c1, c3, n_splits)


@triton.jit
def combine_head(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, n_splits, token, head,
    stride_o_t, stride_o_h, stride_pa_s, stride_pa_t, stride_pa_h, stride_pm_s, stride_pm_t,
    stride_pm_h, xq_ptr, xd_ptr, xs_ptr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr, ROUND: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """One head's n_splits slices of (token, head) combined into its output row, stored (and
    with ROUND rounded to int8 from the stored values); returns the stored row. The partials
    are read from L2 (.cg): other programs wrote them."""
    s = tl.arange(0, SPLITS)
    s_ok = s < n_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pm_off = s * stride_pm_s + token * stride_pm_t + head * stride_pm_h
    m = tl.load(part_m_ptr + pm_off, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_l_ptr + pm_off, mask=s_ok, other=0.0, cache_modifier=".cg")
    pa_off = s[:, None] * stride_pa_s + token * stride_pa_t + head * stride_pa_h + d[None, :]
    pa_ok = s_ok[:, None] & d_ok[None, :]
    acc = tl.load(part_acc_ptr + pa_off, mask=pa_ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty slices weigh 0
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    o = to_dtype(o, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + d, o, mask=d_ok)
    if ROUND:  # the head's sub-blocks of the output row, from the stored values
        b0 = head * (HEAD_DIM // W)
        y = tl.reshape(o.to(tl.float32), (BLOCK_D // W, W))
        round_blocks(y, b0, b0 + HEAD_DIM // W, xq_ptr, xd_ptr, xs_ptr, W, G)
    return o


@triton.jit
def fold_splits(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tickets_ptr, n_splits, token, kv_head,
    stride_o_t, stride_o_h, stride_pa_s, stride_pa_t, stride_pa_h, stride_pm_s, stride_pm_t,
    stride_pm_h, xq_ptr, xd_ptr, xs_ptr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr, ROUND: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """After a decode program stored its slice's partials of (token, kv_head): it draws a
    ticket (an atomic counter at ``tickets[program_id(0) * num_programs(1) + kv_head]``,
    acquire-release at GPU scope after a CTA barrier, as ``split_tickets``); the last of the
    n_splits slices combines the GROUP heads one after the other (combine_head, as the combine
    launch's programs each do one) and sets the counter back to zero for the next launch.
    SPLITS: the launch's slices rounded up to a power of two."""
    at = tickets_ptr + tl.program_id(0) * tl.num_programs(1) + kv_head
    tl.debug_barrier()  # every thread's partials are stored before the ticket is drawn
    ticket = tl.atomic_add(at, 1, sem="acq_rel", scope="gpu")
    if ticket == n_splits - 1:
        for h in tl.static_range(GROUP):
            combine_head(
                out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, n_splits, token,
                kv_head * GROUP + h, stride_o_t, stride_o_h, stride_pa_s, stride_pa_t,
                stride_pa_h, stride_pm_s, stride_pm_t, stride_pm_h, xq_ptr, xd_ptr, xs_ptr,
                HEAD_DIM, BLOCK_D, SPLITS, INTERPRETED, ROUND, W, G,
            )  # fmt: skip
        tl.atomic_xchg(at, 0, sem="relaxed", scope="gpu")


@triton.jit
def _probe_record(probe_ptr, g0, g1, g3, c0, c1, c3, n_splits):
    """One program's record (shared.kernels.probe): its start, wait_prev's return and its end,
    then its SM, program ids, grid size, the mark 2 (a combine program) and the split count."""
    grid = tl.num_programs(0) * tl.num_programs(1)
    probe.write_record(
        probe_ptr, g0, g1, g3, g3, c0, c1, c3, c3, probe.sm_id(0), tl.program_id(0),
        tl.program_id(1), 0, grid, 2, n_splits, 0,
    )  # fmt: skip
