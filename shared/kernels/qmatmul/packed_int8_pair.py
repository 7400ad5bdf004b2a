"""Two batch-1 GEMVs of one activation row, each of its own type, in one launch.

Llama-3 Q4_K_M keeps q and k in Q4_K (one weight of 5,120 rows since their rows are
concatenated at load time) and v in Q6_K in half of its layers, so those layers ran two rows
GEMVs back to back: the Q6_K v of 1,024 rows cost as much as the q/k launch, about 4 µs of
exposed time each (BENCHMARKS.md 2026-12-01 (ab)), while its 3.4 MB would stream in under one.
Here one grid holds both: its first ``tiles_a`` row tiles multiply weight A, the rest weight
B, every tile with the same split count along K. Each program runs the rows GEMV's own loop
(``packed_int8_rows.row_sums``, compiled once per type: a program takes one branch) and its
split-K finish (``split_tickets.finish_rows``) into its weight's output, partials and
tickets. The activations come rounded for both layouts (``norm.add_rms_norm_int8``), so the
results are the two launches' exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.gdc import launch_kw, launch_next, pdl
from shared.kernels.qmatmul.layout import CHUNK, PackedWeight
from shared.kernels.qmatmul.layout import ROWS as _ROWS
from shared.kernels.qmatmul.norm_ahead import sums_block
from shared.kernels.qmatmul.packed_gemm import fields, planes, strides
from shared.kernels.qmatmul.packed_int8_rows import ROWS, row_sums
from shared.kernels.qmatmul.packed_int8_rows_policy import WEIGHT_HINTS, late_next, register_cap
from shared.kernels.qmatmul.packed_matmul import split_targets
from shared.kernels.qmatmul.qkv_rope import QKVRope, finish_qkv_rope, no_rope_args, qkv_angles
from shared.kernels.qmatmul.split_tickets import finish_rows

__all__ = ["gemv_int8_pair_kernel", "pair_splits", "rows_gemv_pair"]


@triton.jit
def gemv_int8_pair_kernel(
    xq_a, xd_a, xs_a, q_a, hi_a, sc_a, mn_a, d_a, dmin_a, out_a, part_a, tickets_a,
    xq_b, xd_b, xs_b, q_b, hi_b, sc_b, mn_b, d_b, dmin_b, out_b, part_b, tickets_b,
    pos_ptr, slot_ptr, kc_ptr, vc_ptr, ff_ptr, row0, q_dim, kv_dim, rope_scale, rope_step,  # ROPE
    sums_ptr, norm_k, norm_eps,  # NORM_BLOCK > 0: the norm's scale still to apply (norm_ahead)
    n_a, n_b, tiles_a, chunks_a, chunks_b, per_a, per_b,
    sq_a, ss_a, sd_a, sq_b, ss_b, sd_b,
    QTYPE_A: tl.constexpr, HI_A: tl.constexpr, W_A: tl.constexpr, G_A: tl.constexpr,
    QTYPE_B: tl.constexpr, HI_B: tl.constexpr, W_B: tl.constexpr, G_B: tl.constexpr,
    KW: tl.constexpr, SPLITS: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    INTERPRETED: tl.constexpr, CM: tl.constexpr, EP: tl.constexpr, SEP: tl.constexpr,
    ROPE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 128, ROPE_DIM: tl.constexpr = 128,
    HAS_FF: tl.constexpr = False, LATE_NEXT: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 0,
):  # fmt: skip
    """Grid (tiles_a + row tiles of B, SPLITS): programs of the first tiles_a tiles multiply
    weight A, the others B. Per weight: the row rounded for its layout (xq, xd, xs), its
    planes, output, split-K partials and tickets, rows, chunks and chunks a split, strides.
    ROPE: A's rows are fused Q/K/V rows from row0 on, B's the n_a after them; their epilogue
    rotates q and k and writes k and v to the cache (``qkv_rope``). LATE_NEXT: launch_next
    after the weight loop (``packed_int8_rows_policy.late_next``). NORM_BLOCK > 0: both roundings
    are ``h * w`` awaiting the norm's scale, from sums_ptr (``norm_ahead``)."""
    if not LATE_NEXT:
        launch_next(PDL)
    t = tl.program_id(0)
    split = tl.program_id(1)
    if t < tiles_a:
        tile = t.to(tl.int64)
        c0 = split * per_a
        rows = tile * ROWS + tl.arange(0, ROWS)
        if ROPE:
            cos, sin = qkv_angles(pos_ptr, ff_ptr, row0, rows, rope_scale, rope_step, ROWS,
                                  HEAD_DIM, ROPE_DIM, HAS_FF)  # fmt: skip
        y, _ = row_sums(xq_a, xq_a, xd_a, xs_a, q_a, hi_a, sc_a, mn_a, d_a, dmin_a, tile, c0,
                        tl.minimum(c0 + per_a, chunks_a), sq_a, ss_a, sd_a, QTYPE_A, HI_A, W_A, G_A,
                        KW, PREFETCH, False, PDL, INTERPRETED, CM, EP, SEP, sums_ptr, norm_k,
                        norm_eps, NORM_BLOCK, sums_ptr, rows, 0, False)  # fmt: skip
        if LATE_NEXT:
            launch_next(PDL)
        if ROPE:
            finish_qkv_rope(out_a, part_a, tickets_a, y, rows, n_a, cos, sin, slot_ptr, kc_ptr,
                            vc_ptr, row0, q_dim, kv_dim, ROWS, SPLITS, HEAD_DIM, ROPE_DIM,
                            INTERPRETED)  # fmt: skip
        else:
            finish_rows(out_a, part_a, tickets_a, y, rows, n_a, ROWS, SPLITS, 0)
    else:
        tile = (t - tiles_a).to(tl.int64)
        c0 = split * per_b
        rows = tile * ROWS + tl.arange(0, ROWS)
        if ROPE:
            cos, sin = qkv_angles(pos_ptr, ff_ptr, row0 + n_a, rows, rope_scale, rope_step, ROWS,
                                  HEAD_DIM, ROPE_DIM, HAS_FF)  # fmt: skip
        y, _ = row_sums(xq_b, xq_b, xd_b, xs_b, q_b, hi_b, sc_b, mn_b, d_b, dmin_b, tile, c0,
                        tl.minimum(c0 + per_b, chunks_b), sq_b, ss_b, sd_b, QTYPE_B, HI_B, W_B, G_B,
                        KW, PREFETCH, False, PDL, INTERPRETED, CM, EP, SEP, sums_ptr, norm_k,
                        norm_eps, NORM_BLOCK, sums_ptr, rows, 0, False)  # fmt: skip
        if LATE_NEXT:
            launch_next(PDL)
        # the tickets of program_id(0) are drawn: B's tile + tiles_a
        if ROPE:
            finish_qkv_rope(out_b, part_b, tickets_b - tiles_a, y, rows, n_b, cos, sin, slot_ptr,
                            kc_ptr, vc_ptr, row0 + n_a, q_dim, kv_dim, ROWS, SPLITS, HEAD_DIM,
                            ROPE_DIM, INTERPRETED)  # fmt: skip
        else:
            finish_rows(out_b, part_b, tickets_b - tiles_a, y, rows, n_b, ROWS, SPLITS, 0)


def pair_splits(a: PackedWeight, b: PackedWeight, splits: int) -> int | None:
    """The split count both weights take in one launch, from A's (`splits`): each weight's
    chunks cut into exactly that many non-empty slices; None when B's cannot be."""
    chunks_a = a.shape[1] // CHUNK[a.qtype]
    chunks_b = b.shape[1] // CHUNK[b.qtype]
    s = triton.cdiv(chunks_a, triton.cdiv(chunks_a, splits))
    if triton.cdiv(chunks_b, triton.cdiv(chunks_b, s)) != s:
        return None
    return s


def rows_gemv_pair(
    x: torch.Tensor,  # [1, K] (only its device and dtype are read: int8_a/int8_b hold the row)
    a: PackedWeight,
    b: PackedWeight,
    int8_a: tuple[torch.Tensor, ...],
    int8_b: tuple[torch.Tensor, ...],
    cfg: dict,
    splits: int,
    interp: bool,
    rope: tuple[QKVRope, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ unpack(a).T, x @ unpack(b).T) in x's dtype, [1, N_a] and [1, N_b], from x rounded
    for each weight's layout (five each: awaiting the norm's scale, ``norm_ahead``); cfg (A's
    rows config): num_warps and PREFETCH; splits from ``pair_splits``. Both weights
    interleaved (``packed_rows``) of one K. rope: (the ``QKVRope`` target, the fused Q/K/V row
    of A's row 0; B's rows follow A's): q rotated in the outputs, k and v written to the cache
    (``qkv_rope``)."""
    if not (a.rows32 and b.rows32) or a.shape[1] != b.shape[1]:
        raise ValueError(f"rows_gemv_pair: interleaved weights of one K, got {a.shape} {b.shape}")
    chunks_a, chunks_b = a.shape[1] // CHUNK[a.qtype], b.shape[1] // CHUNK[b.qtype]
    out_a = torch.empty((1, a.shape[0]), dtype=x.dtype, device=x.device)
    out_b = torch.empty((1, b.shape[0]), dtype=x.dtype, device=x.device)
    per_a, _, targets_a = split_targets(out_a, a, chunks_a, splits)  # pair_splits: both
    per_b, _, targets_b = split_targets(out_b, b, chunks_b, splits)  # take `splits` slices
    tiles_a, tiles_b = triton.cdiv(a.shape[0], _ROWS), triton.cdiv(b.shape[0], _ROWS)
    cm, ep, sep = WEIGHT_HINTS
    fa = {f"{k}_A": v for k, v in fields(a).items()}
    fb = {f"{k}_B": v for k, v in fields(b).items()}
    warps = cfg.get("num_warps", 4)
    regs = register_cap(cfg, a.qtype, b.qtype)
    early = pdl(x.device, gemv_int8_pair_kernel)
    rope_args = rope[0].kernel_args(rope[1]) if rope else no_rope_args(out_a)
    if (len(int8_a) == 5) != (len(int8_b) == 5):
        raise ValueError("rows_gemv_pair: both roundings await the norm's scale or neither")
    k = a.shape[1]
    norm = (*int8_a[3:], sums_block(k)) if len(int8_a) == 5 else (out_a, 0.0, 0)
    gemv_int8_pair_kernel[(tiles_a + tiles_b, splits)](
        *int8_a[:3], *planes(a), *targets_a, *int8_b[:3], *planes(b), *targets_b, *rope_args,
        norm[0], k, norm[1], a.shape[0], b.shape[0], tiles_a, chunks_a, chunks_b, per_a, per_b,
        *strides(a), *strides(b), **fa, **fb, KW=warps, SPLITS=splits,
        PREFETCH=bool(cfg.get("PREFETCH")), PDL=early, INTERPRETED=interp,
        CM=cm, EP=ep, SEP=sep, **(rope[0].constexprs() if rope else {}),
        LATE_NEXT=late_next(rope is not None, a.qtype, b.qtype), NORM_BLOCK=norm[2],
        num_warps=warps, maxnreg=regs, **launch_kw(early),
    )  # fmt: skip
    return out_a, out_b
