"""The rows GEMV for a few activation rows (decode batches of 2 and up, speculative checks).

At batch 1 ``packed_int8_rows`` streams a weight at 3.3-3.6 TB/s on the H200; the GEMMs that
took two rows and up (``packed_gemm_first``) read it at 0.5-1.6 TB/s, so a step of two
sequences cost several times one of one. Here a program is the rows GEMV's (a warp a tile of
32 weight rows, a thread a row, ``KW`` chunks in flight, split-K), but it multiplies each
chunk's codes by ``MR`` activation rows: the weight words are loaded and unpacked once
(``packed_int8_rows.unpack``), and only the integer dot products, the activations' loads and
the sub-block scaling repeat a row (``accumulate``). Batches of more than MR rows take more
programs along the grid's first axis: the row groups of one weight tile are neighbours in the
launch order, so the words they share come from L2.

Activations are rounded per row as at batch 1 (``int8_activations.prepare_int8``, one launch),
so each row's result equals the rows GEMV's of that row alone up to float32 summation order
(tests/test_kernel_packed_int8_rows_batch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.device import num_sms, resident_programs
from shared.kernels.gdc import launch_kw, launch_next, pdl, wait_prev
from shared.kernels.qmatmul.int8_activations import prepare_int8
from shared.kernels.qmatmul.layout import CHUNK, ROWS_TYPES, PackedWeight
from shared.kernels.qmatmul.layout import ROWS as _ROWS
from shared.kernels.qmatmul.packed_gemm import fields, planes, strides
from shared.kernels.qmatmul.packed_int8_rows import accumulate, unpack
from shared.kernels.qmatmul.packed_int8_rows_loads import fetch
from shared.kernels.qmatmul.packed_int8_rows_policy import WEIGHT_HINTS
from shared.kernels.qmatmul.split_tickets import store_rows

__all__ = [
    "BATCH_MR",
    "BATCH_ROWS",
    "batch_config",
    "gemv_int8_rows_batch_kernel",
    "launch_int8_rows_batch",
    "takes",
]

ROWS = tl.constexpr(_ROWS)
# the most activation rows packed_matmul gives this kernel (more: the decode-batch GEMMs); at 8
# rows it lost to them on the H200 (BENCHMARKS (ad))
BATCH_ROWS = 4
# the most activation rows one program multiplies (MR): past 4 the registers (255 at 8 for Q4_K)
# cost more occupancy than the shared unpacking saves
BATCH_MR = 4


@triton.jit
def _step(accs, cb, c1, loaded, xq_ptr, xd_ptr, xs_ptr, m0, M, stride_xq, stride_xd,
          QTYPE: tl.constexpr, HI: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
          KW: tl.constexpr, MR: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """The chunks' codes unpacked once, then each activation row's sums added to its
    accumulator (rows past M read row M - 1 again; they are not stored)."""
    codes, meta = unpack(loaded, QTYPE, HI, W, KW, INTERPRETED)
    out = ()
    for i in tl.static_range(MR):
        m = tl.minimum(m0 + i, M - 1)
        acc = accumulate(accs[i], cb, c1, codes, meta, xq_ptr + m * stride_xq,
                         xd_ptr + m * stride_xd, xs_ptr + m * stride_xd, QTYPE, W, G, KW,
                         INTERPRETED)  # fmt: skip
        out = out + (acc,)
    return out


@triton.jit
def _finish(accs, out_ptr, part_ptr, tickets_ptr, rows, m0, M, N, stride_out,
            SPLITS: tl.constexpr, MR: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """The row tile's outputs for the program's activation rows: stored directly without
    split-K, else partials ([M, SPLITS, N]) and a ticket a (row group, tile), the last
    program adding them in split order (as ``split_tickets.finish_rows``)."""
    if SPLITS == 1:
        for i in tl.static_range(MR):
            if m0 + i < M:
                store_rows(out_ptr + (m0 + i) * stride_out, tl.sum(accs[i], axis=1), rows, N,
                           ROWS, ACT, 1)  # fmt: skip
    else:
        s = tl.program_id(2)
        for i in tl.static_range(MR):
            m = tl.minimum(m0 + i, M - 1)  # (a repeated row stores the same partials again)
            tl.store(part_ptr + (m * SPLITS + s) * N + rows, tl.sum(accs[i], axis=1),
                     mask=rows < N)  # fmt: skip
        tl.debug_barrier()  # every thread's partials are stored before the ticket is drawn
        slot = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        ticket = tl.atomic_add(tickets_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:
            for i in tl.static_range(MR):
                if m0 + i < M:
                    y = tl.zeros((ROWS,), dtype=tl.float32)
                    for t in tl.static_range(SPLITS):
                        y += tl.load(part_ptr + ((m0 + i) * SPLITS + t) * N + rows,
                                     mask=rows < N, other=0.0, cache_modifier=".cg")  # fmt: skip
                    store_rows(out_ptr + (m0 + i) * stride_out, y, rows, N, ROWS, ACT, 1)
            tl.atomic_xchg(tickets_ptr + slot, 0, sem="relaxed", scope="gpu")


@triton.jit
def gemv_int8_rows_batch_kernel(
    xq_ptr, xd_ptr, xs_ptr,  # the rows rounded to int8 ([M, K / 4], [M, K / W] twice)
    q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr,  # row-interleaved planes (packed_rows)
    out_ptr,  # [M, N] in the output dtype ([M, N / 2] with ACT)
    part_ptr, tickets_ptr,  # split-K partials [M, SPLITS, N] float32; tickets (split_tickets)
    M, N, n_chunks, per_split, stride_q, stride_s, stride_d, stride_xq, stride_xd, stride_out,
    QTYPE: tl.constexpr,
    HI: tl.constexpr,
    W: tl.constexpr,  # words per chunk
    G: tl.constexpr,  # fields (sub-blocks) per word
    KW: tl.constexpr,  # chunks in flight (one a warp with num_warps = KW)
    SPLITS: tl.constexpr,  # programs along K (program_id(2))
    MR: tl.constexpr,  # activation rows a program (program_id(0): the group of MR rows)
    ACT: tl.constexpr,  # > 0: rows are gate/up pairs (packed_matmul's act)
    PDL: tl.constexpr,  # launched early (gdc): the first chunks load before wait_prev
    INTERPRETED: tl.constexpr,
    CM: tl.constexpr = "",  # the weight words' cache modifier and eviction policy (WEIGHT_HINTS)
    EP: tl.constexpr = "",
    SEP: tl.constexpr = "",  # the scale words' eviction policy
):  # fmt: skip
    launch_next(PDL)
    m0 = tl.program_id(0) * MR
    tile = tl.program_id(1).to(tl.int64)
    rows = tile * ROWS + tl.arange(0, ROWS)
    c0 = tl.program_id(2) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    accs = (tl.zeros((ROWS, KW), dtype=tl.float32),) * MR
    if INTERPRETED:  # it cannot range() over tensor bounds with numpy >= 2.4 (triton#9171)
        cb = c0
        while cb < c1:
            cur = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb, c1,
                        stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            accs = _step(accs, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, m0, M, stride_xq, stride_xd,
                         QTYPE, HI, W, G, KW, MR, True)  # fmt: skip
            cb += KW
    else:
        # the first chunks' weights load while the previous kernel ends (PDL); the rest as a loop
        cur = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, c0, c1,
                    stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
        wait_prev(PDL)
        accs = _step(accs, c0, c1, cur, xq_ptr, xd_ptr, xs_ptr, m0, M, stride_xq, stride_xd,
                     QTYPE, HI, W, G, KW, MR, False)  # fmt: skip
        for cb in range(c0 + KW, c1, KW):
            cur = fetch(QTYPE, HI, q_ptr, hi_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, tile, cb, c1,
                        stride_q, stride_s, stride_d, W, KW, CM, EP, SEP)  # fmt: skip
            accs = _step(accs, cb, c1, cur, xq_ptr, xd_ptr, xs_ptr, m0, M, stride_xq, stride_xd,
                         QTYPE, HI, W, G, KW, MR, False)  # fmt: skip
    _finish(accs, out_ptr, part_ptr, tickets_ptr, rows, m0, M, N, stride_out, SPLITS, MR, ACT)


def takes(pw: PackedWeight, m: int) -> bool:
    """Whether m rows of pw run this kernel by default: 2 .. BATCH_ROWS rows of interleaved
    planes of a rows type."""
    return pw.rows32 and 1 < m <= BATCH_ROWS and pw.qtype in ROWS_TYPES


def batch_config(pw: PackedWeight, m: int) -> dict[str, int]:
    """The batch rows GEMV's config for m rows of pw: the rows in as few programs as BATCH_MR
    allows, evenly (MR = m up to 4; 6 rows: two of 3), 4 warps, K split until about 31 warps an
    SM (as ``default_rows_split``), the registers the compiler's choice (a budget of 128 for
    programs of 2 rows moved W1 by under 0.2 %, BENCHMARKS.md (af))."""
    mr = triton.cdiv(m, triton.cdiv(m, BATCH_MR))
    return {"ROWS": 1, "num_warps": 4, "MR": mr}


def batch_split(pw: PackedWeight, groups: int, warps: int) -> int:
    """Splits along K for `groups` row groups: about 31 warps an SM, at least one chunk a warp
    a split, at most 16."""
    tiles = triton.cdiv(pw.shape[0], _ROWS)
    n_chunks = pw.shape[1] // CHUNK[pw.qtype]
    target = 31 * num_sms(pw.q.device) // warps
    return max(1, min(16, target // (tiles * groups), n_chunks // warps))


def wave_split(splits: int, programs: int, resident: int, sms: int) -> int:
    """At most `splits` splits of `programs` programs each (row groups times tiles) that fit one
    wave of `resident` programs on each of `sms` SMs; at least 1."""
    return max(1, min(splits, resident * sms // programs))


def launch_int8_rows_batch(
    x: torch.Tensor, pw: PackedWeight, out: torch.Tensor, cfg: dict, act: int, interp: bool,
    int8: tuple[torch.Tensor, ...] | None = None,
) -> None:  # fmt: skip
    """out [M, N] (or [M, N / 2] with act) = x [M, K] @ unpack(pw).T by the batch rows GEMV;
    cfg: num_warps (chunks in flight), MR (activation rows a program, default all), SPLIT_K
    (default ``batch_split``); int8: x's rows rounded for pw's layout already ([M, K / 4],
    [M, K / W] twice, e.g. by the RMSNorm that made them: ``norm.add_rms_norm_int8``), else a
    launch rounds them."""
    if pw.qtype not in ROWS_TYPES or not pw.rows32:
        raise ValueError(f"packed_matmul: no batch rows GEMV for {pw.qtype.name} planes")
    m = x.shape[0]
    mr = max(1, min(cfg.get("MR", m), m))
    warps = cfg.get("num_warps", 4)
    groups = triton.cdiv(m, mr)
    tiles = triton.cdiv(pw.shape[0], _ROWS)
    n_chunks = pw.shape[1] // CHUNK[pw.qtype]
    splits = cfg.get("SPLIT_K") or batch_split(pw, groups, warps)
    if groups * tiles > pw.tickets.numel():
        raise ValueError(f"packed_matmul: {m} rows in groups of {mr} need more tickets than rows")
    if int8 is None:
        xq, xd, xs = prepare_int8(x, pw)
    else:
        xq, xd, xs = int8
        if xq.shape != (m, pw.shape[1] // 4):
            raise ValueError(f"packed_matmul: int8 rows {tuple(xq.shape)} for x {tuple(x.shape)}")
    cm, ep, sep = WEIGHT_HINTS
    early = pdl(x.device, gemv_int8_rows_batch_kernel)

    def launch(splits: int, warmup: bool = False):
        per_split = triton.cdiv(n_chunks, splits)
        splits = triton.cdiv(n_chunks, per_split)
        part = out
        if splits > 1:  # (for a warmup too: the partials' dtype is in the kernel's signature)
            part = torch.empty((m, splits, pw.shape[0]), dtype=torch.float32, device=x.device)
        grid = (groups, tiles, splits)
        kernel = gemv_int8_rows_batch_kernel.warmup if warmup else gemv_int8_rows_batch_kernel[grid]
        return kernel(
            xq, xd, xs, *planes(pw), out, part, pw.tickets, m, pw.shape[0], n_chunks, per_split,
            *strides(pw), xq.stride(0), xd.stride(0), out.stride(0), **fields(pw), KW=warps,
            SPLITS=splits, MR=mr, ACT=act, PDL=early, INTERPRETED=interp, CM=cm, EP=ep, SEP=sep,
            num_warps=warps, maxnreg=cfg.get("MAXNREG"), **launch_kw(early),
            **({"grid": grid} if warmup else {}),
        )  # fmt: skip

    # without a SPLIT_K, K is split only as far as one wave of programs (the SMs times the
    # programs an SM holds with the compiled kernel's registers, ``device.resident_programs``),
    # not about 31 warps an SM whatever the registers (``batch_split``): H200, W1 Q4_K_M +6.1 /
    # +3.9 / +4.8 % at batches 2 / 3 / 4 (BENCHMARKS.md (aj)). The split is found once a weight
    # and launch form (PackedWeight.wave_splits)
    if not cfg.get("SPLIT_K") and not interp and splits > 1:
        form = (x.device, m, mr, warps, splits, act, cm, ep, sep, cfg.get("MAXNREG"), early,
                out.dtype)  # fmt: skip
        if form not in pw.wave_splits:
            # the registers of the kernel as compiled for batch_split's count (compiled, not run)
            kernel = launch(splits, warmup=True)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            kernel._init_handles()  # loads it: n_regs comes with the module
            resident = resident_programs(x.device, kernel.n_regs, warps, kernel.metadata.shared)
            pw.wave_splits[form] = wave_split(splits, groups * tiles, resident, num_sms(x.device))
        splits = pw.wave_splits[form]
    launch(splits)
