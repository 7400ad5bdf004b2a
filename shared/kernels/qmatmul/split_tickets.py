"""Split-K for the GEMVs without a second launch: the last program of a row tile adds the partials.

A GEMV split over its chunks (``program_id(1)``) used to store float32 partials and leave their
sum to ``sum_splits_kernel``: one more launch per matmul, 161 a Llama-3-8B token (0.36 ms of a
4.6 ms step on the H200, BENCHMARKS.md 2026-11-30 (d)). Here every program stores its partial
row sums, then takes a ticket for its row tile (an atomic counter, acquire-release at GPU scope
after a CTA barrier: the release covers the whole program's stores, as CUTLASS's semaphore).
The program that draws the last ticket reads the partials back from L2 in split order (so the
result does not depend on which program finished last), stores the output (with the gated
activation when asked) and sets the counter back to zero for the weight's next launch.

The counters live with the weight (``PackedWeight.tickets``, one int32 a row, zero between
launches). Launches of one weight must not overlap on two streams; the engine uses one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shared.kernels.qmatmul.int8_activations import round_blocks
from shared.kernels.qmatmul.packed_gemm import gated

__all__ = ["finish_rows", "release_tile", "round_gated", "store_rows", "tile_sums"]


@triton.jit
def finish_rows(
    out_ptr,  # [N] (or [N / 2] with ACT) in the output dtype
    part_ptr,  # [SPLITS, N] float32 partials (unused when SPLITS == 1)
    tickets_ptr,  # [>= row tiles] int32 counters, zero between launches
    y,  # [BLOCK_N] float32: this program's sums over its chunks
    rows,
    N,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    ACT: tl.constexpr,
):
    """Returns whether this program stored the tile's results (the last of its splits)."""
    last, acc = tile_sums(part_ptr, tickets_ptr, y, rows, N, BLOCK_N, SPLITS)
    if last:
        store_rows(out_ptr, acc, rows, N, BLOCK_N, ACT)
        release_tile(tickets_ptr, SPLITS)
    return last


@triton.jit
def tile_sums(part_ptr, tickets_ptr, y, rows, N, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """(whether this program is the last of its tile's splits, and then the tile's sums in
    split order; else its own): finish_rows without the store, for epilogues of their own
    (``qkv_rope``), which call release_tile after storing."""
    last = True
    acc = y
    if SPLITS > 1:
        tl.store(part_ptr + tl.program_id(1) * N + rows, y, mask=rows < N)
        tl.debug_barrier()  # every thread's partials are stored before the ticket is drawn
        ticket = tl.atomic_add(tickets_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLITS - 1
        if last:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(
                    part_ptr + s * N + rows, mask=rows < N, other=0.0, cache_modifier=".cg"
                )
    return last, acc


@triton.jit
def release_tile(tickets_ptr, SPLITS: tl.constexpr):
    """The last program of a tile's splits sets its counter back to zero (the next launch)."""
    if SPLITS > 1:
        tl.atomic_xchg(tickets_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")


@triton.jit
def round_gated(out_ptr, tickets_ptr, n_tiles, xq_ptr, xd_ptr, xs_ptr, BLOCK_N: tl.constexpr,
                W: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """After the program that stored a row tile's gated outputs (BLOCK_N / 2 of them) did so:
    round them to int8 in layout (W, G) for the GEMV that reads them next, from the stored
    values. A sub-block of W outputs spans W / (BLOCK_N / 2) tiles: the last of them to store
    (a ticket at ``tickets[n_tiles + sub-block]``, after the split-K counters) reads the
    sub-block back from L2 and rounds it, and sets the counter back to zero."""
    TILES: tl.constexpr = W // (BLOCK_N // 2)
    blk = tl.program_id(0) // TILES
    tl.debug_barrier()  # every thread's outputs are stored before they are read (or released)
    go = True
    if TILES > 1:
        ticket = tl.atomic_add(tickets_ptr + n_tiles + blk, 1, sem="acq_rel", scope="gpu")
        go = ticket == TILES - 1
    if go:
        v = tl.load(out_ptr + blk * W + tl.arange(0, W), cache_modifier=".cg").to(tl.float32)
        round_blocks(tl.reshape(v, (1, W)), blk, blk + 1, xq_ptr, xd_ptr, xs_ptr, W, G)
        if TILES > 1:
            tl.atomic_xchg(tickets_ptr + n_tiles + blk, 0, sem="relaxed", scope="gpu")


@triton.jit
def store_rows(out_ptr, y, rows, N, BLOCK_N: tl.constexpr, ACT: tl.constexpr,
               TILE_AXIS: tl.constexpr = 0):  # fmt: skip
    """A row tile's BLOCK_N results, or with ACT the gated activation of their gate/up pairs
    (the tile: program_id(TILE_AXIS))."""
    if ACT:
        g, u = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
        tile = tl.program_id(TILE_AXIS).to(tl.int64)
        half = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + half, gated(g, u, ACT).to(out_ptr.dtype.element_ty), mask=half < N // 2)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)
