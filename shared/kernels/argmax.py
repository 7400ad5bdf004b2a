"""Row argmax of logits in Triton: greedy decoding's pick over a large vocabulary.

torch reduces a row with one program: at batch 1 a 128,256-entry row took 27 us on the H200
(BENCHMARKS.md (ab)). Here a row is cut into slices: each program finds its slice's maximum
and that maximum's first index, and counts itself done in a counter buffer (``counts``, zeros,
kept by the caller); the row's last slice picks among the slices, then sets the count back to
zero: one launch. The result is ``torch.argmax``'s: the first index of the maximum, NaN
counting above every number (the first NaN wins), read in the logits' own dtype (any float; no
float32 copy).

``host``: the picks are also stored into that tensor by the same program (pinned host memory,
mapped into the device's address space): the step's ids reach the host with no copy of their
own (``engine._to_host``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.gdc import launch_next, pdl

_SLICE = 4096  # entries a program reads


@triton.jit
def _first_max(vals, idx, BIG: tl.constexpr):
    """(the maximum, NaN above all, and its first index) of vals [BLOCK] at idx; BIG for
    entries out of range (their vals are -inf)."""
    nan = vals != vals
    nan_at = tl.min(tl.where(nan, idx, BIG))
    top = tl.max(tl.where(nan, -float("inf"), vals))
    top_at = tl.min(tl.where((vals == top) & (idx < BIG), idx, BIG))
    has_nan = nan_at < BIG
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_at, top_at)


@triton.jit
def _slice_kernel(
    x_ptr, val_ptr, idx_ptr, count_ptr, out_ptr, stride_x, n, n_slices, host_ptr=None,
    BLOCK: tl.constexpr = 4096, PICK: tl.constexpr = 16, HOST: tl.constexpr = False,
    NEXT: tl.constexpr = False,
):  # fmt: skip
    """A slice's maximum and its first index; then the row's last slice to finish (by
    count_ptr[row]) picks among them into out_ptr[row]. NEXT: the next kernel's programs may
    start (gdc; this one is launched after the kernel before it, as usual)."""
    launch_next(NEXT)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    idx = s * BLOCK + tl.arange(0, BLOCK)
    live = idx < n
    vals = tl.load(x_ptr + row * stride_x + idx, mask=live, other=-float("inf")).to(tl.float32)
    top, at = _first_max(vals, tl.where(live, idx, 2147483647), 2147483647)
    tl.store(val_ptr + row * n_slices + s, top)
    tl.store(idx_ptr + row * n_slices + s, at)
    # release: the stores above are seen by the program that takes the last count (acquire)
    done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
    if done == n_slices - 1:
        _pick_row(val_ptr, idx_ptr, out_ptr, row, n_slices, PICK, host_ptr, HOST)
        tl.store(count_ptr + row, 0)  # every slice of this launch has counted: the next may


@triton.jit
def _pick_row(val_ptr, idx_ptr, out_ptr, row, n_slices, BLOCK: tl.constexpr, host_ptr=None,
              HOST: tl.constexpr = False):  # fmt: skip
    # the slices' results loaded past L1 (".cg": in L2, where the other programs stored them)
    s = tl.arange(0, BLOCK)
    live = s < n_slices
    vals = tl.load(val_ptr + row * n_slices + s, mask=live, other=-float("inf"),
                   cache_modifier=".cg")  # fmt: skip
    at = tl.load(idx_ptr + row * n_slices + s, mask=live, other=2147483647, cache_modifier=".cg")
    # slices are in index order, so the first index of the maximum among their firsts is the
    # row's first; an empty slice never exists (n_slices = cdiv(n, slice))
    _, first = _first_max(vals, at, 2147483647)
    tl.store(out_ptr + row, first.to(tl.int64))
    if HOST:
        tl.store(host_ptr + row, first.to(tl.int64))


def argmax_rows(
    x: torch.Tensor, counts: torch.Tensor, host: torch.Tensor | None = None
) -> torch.Tensor:
    """argmax over the last dim of a [B, V] float tensor: [B] int64. counts: int32 zeros of
    at least B entries on x's device, which launches of one stream share (the launch leaves
    them zero). host: a contiguous [B] int64 tensor the picks are stored into as well (pinned
    host memory, the device's own, or on the CPU x's)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"argmax_rows: a [B, V] float tensor, got {x.dtype} {tuple(x.shape)}")
    if host is not None and (
        host.shape != (x.shape[0],) or host.dtype != torch.int64 or not host.is_contiguous()
    ):
        raise ValueError(f"argmax_rows: host must be a contiguous [{x.shape[0]}] int64 tensor")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    if n == 0 or rows == 0:
        return x.argmax(dim=-1)  # (no rows: nothing to store; an empty row: torch's error)
    n_slices = triton.cdiv(n, _SLICE)
    vals = torch.empty(rows, n_slices, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, n_slices, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    pick = max(16, triton.next_power_of_2(n_slices))  # the pick's block: every slice's result
    if counts.dtype != torch.int32 or counts.numel() < rows or counts.device != x.device:
        raise ValueError(f"argmax_rows: counts must be {rows}+ int32 on {x.device}")
    _slice_kernel[(rows, n_slices)](
        x, vals, idx, counts, out, x.stride(0), n, n_slices, host, BLOCK=_SLICE, PICK=pick,
        HOST=host is not None, NEXT=pdl(x.device, _slice_kernel), num_warps=8,
    )  # fmt: skip
    return out
