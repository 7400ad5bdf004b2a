"""The residual add + RMSNorm after a batch-1 GEMV, in that GEMV's last program (no launch of
its own).

At batch 1 a Llama layer's output projection (``packed_int8_rows``) is followed by
``norm.add_rms_norm_int8``: one more launch that adds the residual, normalizes the row and
rounds it to int8 for the gate/up GEMV, 3.6-3.9 µs a layer of exposed time on the H200
(BENCHMARKS.md (ak): gate/up's programs, launched early, stream their first weights beside
it). Here every program that stores a row tile's outputs (the last of its splits,
``split_tickets.finish_rows``) draws a ticket after them; the last of all the tiles reads the
whole row back from L2 and does that launch's work: the sum with the residual (rounded to its
dtype), the new residual, the normed row and its int8 roundings for up to two layouts
(``int8_activations.round_blocks``). The values are the launch's up to the float32 order of
the sum of squares (tests/test_kernel_norm_tail.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.kernels.qmatmul.int8_activations import int8_buffers_for, round_blocks

__all__ = ["NormTail", "finish_norm", "no_norm_args", "norm_tail"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class NormTail:
    """The norm a GEMV's last program does on its [1, N] output: ``normed = rms_norm(out +
    residual) * weight`` with ``new_residual = out + residual`` (in residual's dtype) and
    normed's int8 roundings by layout (at most two)."""

    residual: torch.Tensor  # [1, N]
    weight: torch.Tensor  # [N]
    eps: float
    normed: torch.Tensor  # [1, N], written
    new_residual: torch.Tensor  # [1, N], written
    rounded: dict  # {(W, G): (xq, xd, xs)}, written

    def results(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(normed, new_residual, rounded) as ``norm.add_rms_norm_int8`` returns them."""
        return self.normed, self.new_residual, self.rounded

    def kernel_args(self) -> tuple:
        bufs = [t for r in self.rounded.values() for t in r]
        bufs += [self.normed] * (6 - len(bufs))  # never read without their layout
        return (self.residual, self.weight, self.normed, self.new_residual, *bufs, self.eps)

    def constexprs(self) -> dict:
        shapes = [v for layout in self.rounded for v in layout] + [32, 8] * (2 - len(self.rounded))
        return {
            "NORM": 1 + len(self.rounded),
            "NORM_BLOCK": triton.next_power_of_2(self.weight.shape[0]),
            "NW1": shapes[0],
            "NG1": shapes[1],
            "NW2": shapes[2],
            "NG2": shapes[3],
        }

    def refusal(self, out_dtype: torch.dtype, n: int) -> str | None:
        """Why a GEMV of n outputs in out_dtype cannot end with this norm, or None."""
        if self.residual.shape != (1, n) or self.residual.dtype != out_dtype:
            return f"residual {self.residual.dtype} {tuple(self.residual.shape)} for [1, {n}]"
        if out_dtype not in _FLOAT_DTYPES or not self.residual.is_contiguous():
            return f"outputs {out_dtype}, residual contiguous {self.residual.is_contiguous()}"
        if self.weight.shape != (n,) or not self.weight.is_contiguous():
            return f"weight {tuple(self.weight.shape)} for {n} outputs"
        if any(n % (w * g) for w, g in self.rounded):
            return f"{n} outputs are not whole chunks of {tuple(self.rounded)}"
        return None


def norm_tail(
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    layouts: tuple[tuple[int, int], ...],
) -> NormTail:
    """A NormTail with its outputs allocated (as ``norm.add_rms_norm_int8`` allocates them
    for one row): layouts, at most two (W, G)."""
    if len(layouts) > 2:
        raise ValueError(f"norm_tail: at most two layouts, got {layouts}")
    n = residual.shape[-1]
    rounded = {layout: int8_buffers_for(n, *layout, residual.device) for layout in layouts}
    return NormTail(
        residual, weight, eps, torch.empty_like(residual), torch.empty_like(residual), rounded
    )


def no_norm_args(out: torch.Tensor) -> tuple:
    """The kernel's norm arguments when it ends with no norm (never read)."""
    return (out,) * 10 + (0.0,)


@triton.jit
def finish_norm(
    out_ptr,  # [N]: the GEMV's outputs, stored by every tile's last program
    tickets_ptr,  # the weight's counters: slot n_tiles is this one's, zero between launches
    res_ptr, nw_ptr, normed_ptr, res_out_ptr,  # NormTail's residual, weight and outputs
    q1_ptr, d1_ptr, s1_ptr, q2_ptr, d2_ptr, s2_ptr,  # its int8 roundings (layouts 1 and 2)
    eps, N,
    NORM: tl.constexpr,  # 1 + the layouts rounded
    NORM_BLOCK: tl.constexpr,  # N rounded up to a power of two
    NW1: tl.constexpr, NG1: tl.constexpr, NW2: tl.constexpr, NG2: tl.constexpr,
):  # fmt: skip
    """Called by the program that stored a row tile's outputs: the last of the tiles
    (program_id(0)) does NormTail's norm on the whole row and sets the counter back."""
    slot = tl.num_programs(0)
    tl.debug_barrier()  # every thread's outputs are stored before the ticket is drawn
    ticket = tl.atomic_add(tickets_ptr + slot, 1, sem="acq_rel", scope="gpu")
    if ticket == slot - 1:
        cols = tl.arange(0, NORM_BLOCK)
        ok = cols < N
        x = tl.load(out_ptr + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = tl.load(res_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x + r).to(res_ptr.dtype.element_ty).to(tl.float32)  # the sum as stored
        tl.store(res_out_ptr + cols, x.to(res_out_ptr.dtype.element_ty), mask=ok)
        mean_sq = tl.sum(x * x, axis=0) / N
        w = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = (x * tl.rsqrt(mean_sq + eps) * w).to(normed_ptr.dtype.element_ty)
        tl.store(normed_ptr + cols, y, mask=ok)
        if NORM >= 2:
            y1 = tl.reshape(y.to(tl.float32), (NORM_BLOCK // NW1, NW1))
            round_blocks(y1, 0, N // NW1, q1_ptr, d1_ptr, s1_ptr, NW1, NG1)
        if NORM == 3:
            y2 = tl.reshape(y.to(tl.float32), (NORM_BLOCK // NW2, NW2))
            round_blocks(y2, 0, N // NW2, q2_ptr, d2_ptr, s2_ptr, NW2, NG2)
        tl.atomic_xchg(tickets_ptr + slot, 0, sem="relaxed", scope="gpu")
