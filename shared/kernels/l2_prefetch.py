"""Weights requested into L2 by a kernel that runs before their GEMV.

A decode step at batch 1 alternates GEMVs, which stream weights at near HBM bandwidth, with
short kernels bound by latency (RoPE, attention and its combine, the norms), during which HBM
idles: on the H200 about 15 us a Llama-3-8B layer (BENCHMARKS.md 2026-12-01 (ag)). A kernel of
that kind may carry a prefetch table: at its start (before ``wait_prev``, since weights are
constants) its threads issue one ``cp.async.bulk.prefetch.L2`` each for pieces of the weights
the next GEMVs read, and go on. The prefetches complete in the background; the GEMVs then find
those bytes in L2 (60 MB on the H200) instead of HBM. A prefetch is a hint: it changes no
result, only where the GEMV's loads are served from.

The table is built once at load time (the weights do not move): ``int64 [2, n]``, row 0 the
pieces' addresses and row 1 their byte counts (each a multiple of 16 and at most ``PIECE``).
Pieces are dealt out strided: piece ``i`` goes to program ``i % programs``, so every SM's bulk
copy unit takes a share. On devices below sm_90, and under the interpreter, the kernels are
compiled without it (``enabled``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.device import interpreted

__all__ = ["PIECE", "enabled", "prefetch_l2", "table"]

PIECE = 32 * 1024  # bytes a thread's one bulk prefetch asks for
_ALIGN = 16  # the instruction's address alignment and size granule


@triton.jit
def _bulk_prefetch(addr, size):
    """One ``cp.async.bulk.prefetch.L2`` a lane for [addr, addr + size); size 0 issues none."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_l2(table_ptr, n_pieces, ON: tl.constexpr, LANES: tl.constexpr):
    """Issue this program's share of the table's prefetches (ON: compiled in at all). LANES:
    the program's threads (32 * num_warps), so that each piece is asked for once."""
    if ON:
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
        pid += tl.program_id(2)
        lanes = tl.arange(0, LANES)
        for base in range(0, n_pieces, programs * LANES):
            i = base + pid + lanes * programs
            ok = i < n_pieces
            addr = tl.load(table_ptr + i, mask=ok, other=0)
            size = tl.load(table_ptr + n_pieces + i, mask=ok, other=0).to(tl.int32)
            _bulk_prefetch(addr, size)


def enabled(device: torch.device, kernel: object) -> bool:
    """Whether `kernel` can issue bulk L2 prefetches on `device`: sm_90 or later, compiled
    (not the interpreter)."""
    return (
        device.type == "cuda"
        and not interpreted(kernel)
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def table(ranges: list[tuple[torch.Tensor, int]]) -> torch.Tensor | None:
    """The prefetch table of the first `nbytes` of each tensor, in order (pieces of at most
    PIECE bytes; a tail shorter than 16 bytes is left out). None when nothing is asked."""
    addrs: list[int] = []
    sizes: list[int] = []
    device = None
    for t, nbytes in ranges:
        if not 0 <= nbytes <= t.numel() * t.element_size():
            raise ValueError(
                f"l2_prefetch: {nbytes} bytes of a {t.numel() * t.element_size()}-byte tensor"
            )
        if not t.is_contiguous():
            raise ValueError("l2_prefetch: tensors must be contiguous")
        base = t.data_ptr()
        if base % _ALIGN:
            raise ValueError(f"l2_prefetch: address {base:#x} is not {_ALIGN}-byte aligned")
        device = t.device
        end = nbytes - nbytes % _ALIGN
        for off in range(0, end, PIECE):
            addrs.append(base + off)
            sizes.append(min(PIECE, end - off))
    if not addrs:
        return None
    return torch.tensor([addrs, sizes], dtype=torch.int64, device=device)
