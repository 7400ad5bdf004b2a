"""The residual add and RMSNorm between two decode GEMVs, without a launch of their own.

At batch 1 a Llama layer ran ``norm.add_rms_norm_int8`` twice: the output projection's and the
down projection's results plus the residual, normed and rounded to int8 for the next GEMVs.
Each launch cost about 2 µs of a Q4_K_M layer's 53 on the H200, and each kernel boundary about
as much again (BENCHMARKS.md 2026-12-02 (am)). The rounding does not need the norm's scale:
``rstd = 1 / sqrt(mean(h^2) + eps)`` is one positive number for the whole row, and the int8
codes of ``h * w * rstd`` are those of ``h * w`` (a sub-block's step scales with it). So:

- the GEMV that makes the output (``norm_rows``, in the last program of each 32-row tile) adds
  the residual to its rows as the norm did (``h``, rounded to the residual's dtype: the new
  residual, bit for bit), stores ``h``, the tile's sum of squares of ``h``, and the int8
  rounding of ``h * w`` for each layout the next GEMVs read (a tile's 32 rows are whole
  sub-blocks of 16 or 32);
- the GEMVs that read that rounding (``rms_scale``) load the row's tile sums with their
  activations and multiply their row sums by ``rstd`` (a dot product is linear in the
  activations: the scales and the sums of a sub-block scale by it alike).

Against the norm's launch this differs in rounding only: the codes come from ``h * w`` in
float32 where the norm rounded ``y`` to the activation dtype first (as llama.cpp does not),
and the mean is summed in tile order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shared.kernels.qmatmul.int8_activations import int8_buffers_for, round_blocks

__all__ = [
    "TILE",
    "NormOut",
    "folds",
    "load_sums",
    "norm_buffers",
    "norm_rows",
    "rms_scale",
    "row_slice",
    "sums_block",
]

TILE = 32  # the rows a producing program stores (packed_rows.ROWS): one sum of squares each
_TILE = tl.constexpr(TILE)


class NormOut(NamedTuple):
    """What a GEMV's epilogue needs to norm its output row for the GEMVs after it."""

    residual: torch.Tensor  # [1, N]: the residual stream before the add
    new_residual: torch.Tensor  # [1, N]: out + residual, stored here
    weight: torch.Tensor  # [N]: the RMSNorm's weight
    sums: torch.Tensor  # [N / TILE] float32: each tile's sum of squares of the new residual
    rounded: tuple  # ((xq, xd, xs, W, G), ...): one or two layouts, h * weight rounded


def norm_buffers(
    residual: torch.Tensor, weight: torch.Tensor, eps: float, layouts: tuple[tuple[int, int], ...]
) -> tuple[NormOut, dict]:
    """The buffers of a norm folded into a GEMV's epilogue: (NormOut, {(W, G): (xq, xd, xs,
    sums, eps)}), the latter the rounding dict the next GEMVs take (``int8`` entries whose
    last two fields ask them for ``rms_scale``)."""
    n = residual.shape[-1]
    sums = torch.empty(n // TILE, dtype=torch.float32, device=residual.device)
    made = {layout: int8_buffers_for(n, *layout, residual.device) for layout in layouts}
    out = NormOut(
        residual,
        torch.empty_like(residual),
        weight,
        sums,
        tuple((*bufs, *layout) for layout, bufs in made.items()),
    )
    return out, {layout: (*bufs, sums, eps) for layout, bufs in made.items()}


def folds(n: int, layouts: tuple[tuple[int, int], ...]) -> bool:
    """Whether a GEMV of n output rows can norm them for GEMVs of these layouts: whole tiles,
    one or two layouts whose sub-blocks are whole within a tile and whose chunks are whole."""
    return (
        n % TILE == 0
        and 1 <= len(layouts) <= 2
        and all(TILE % w == 0 and n % (w * g) == 0 for w, g in layouts)
    )


@triton.jit
def norm_rows(acc, r, w, rows, N, out_dtype: tl.constexpr, hres_ptr, sums_ptr,
              oq1, od1, os1, W1: tl.constexpr, G1: tl.constexpr,
              oq2, od2, os2, W2: tl.constexpr, G2: tl.constexpr):  # fmt: skip
    """A tile's outputs (acc, TILE float32 sums of rows `rows`, stored in out_dtype) plus the
    residual r (float32, as loaded): stored as the new residual, their sum of squares as tile
    program_id(0)'s, and ``h * w`` (w: the norm weight's rows, float32) rounded to int8 in
    layout (W1, G1) and, with W2 > 0, (W2, G2)."""
    live = rows < N
    a = acc.to(out_dtype).to(tl.float32)  # the output as the norm would have read it
    h = (a + r).to(hres_ptr.dtype.element_ty)
    tl.store(hres_ptr + rows, h, mask=live)
    hf = h.to(tl.float32)
    tile = tl.program_id(0)
    tl.store(sums_ptr + tile, tl.sum(hf * hf, axis=0))
    y = hf * w
    TILE_ROWS: tl.constexpr = y.shape[0]
    round_blocks(tl.reshape(y, (TILE_ROWS // W1, W1)), tile * (TILE_ROWS // W1), N // W1, oq1,
                 od1, os1, W1, G1)  # fmt: skip
    if W2 > 0:
        round_blocks(tl.reshape(y, (TILE_ROWS // W2, W2)), tile * (TILE_ROWS // W2), N // W2,
                     oq2, od2, os2, W2, G2)  # fmt: skip


@triton.jit
def row_slice(ptr, rows, N, VOLATILE: tl.constexpr = False):
    """ptr's entries at rows as float32 (zero past N); VOLATILE: issued where it stands."""
    return tl.load(ptr + rows, mask=rows < N, other=0.0, volatile=VOLATILE).to(tl.float32)


@triton.jit
def load_sums(sums_ptr, k, BLOCK: tl.constexpr):
    """The row's tile sums of squares ([BLOCK], zero past k / TILE), issued where they stand
    (volatile: not sunk to their use at the end of the weight loop)."""
    at = tl.arange(0, BLOCK)
    return tl.load(sums_ptr + at, mask=at < k // _TILE, other=0.0, volatile=True)


@triton.jit
def rms_scale(sums, k, eps):
    """1 / sqrt(mean square + eps) of a row of k from its tile sums (load_sums)."""
    return tl.rsqrt(tl.sum(sums, axis=0) / k + eps)


def sums_block(k: int) -> int:
    """load_sums's BLOCK for a row of k activations."""
    return triton.next_power_of_2(max(k // TILE, 1))
