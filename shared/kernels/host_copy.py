"""A small device tensor copied into pinned host memory by a kernel's own stores.

A step's sampled token ids travel to the host after every decode step. As a device->host copy
on the stream, the H200's trace showed each such copy costing several microseconds of an idle
GPU around it (the copy engine's turnaround, 5-8 µs between the step's last kernel, the copy and
the next step's first launch; BENCHMARKS.md 2026-12-03 (at)). A kernel can store into pinned
memory directly (it is mapped into the device's address space), and a kernel boundary on the
stream costs about 1.5 µs. Reference: ``dst.copy_(src)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["copy_to_host"]

_BLOCK = 1024


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


def copy_to_host(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst (pinned host memory, or any memory the device reads and writes) takes src's values
    once the stream reaches this launch; returns dst. Both contiguous, of one shape and dtype."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(
            f"copy_to_host: {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_to_host: src and dst must be contiguous")
    if dst.device.type == "cpu" and src.device.type == "cuda" and not dst.is_pinned():
        raise ValueError("copy_to_host: a host dst must be pinned for the device to write it")
    n = src.numel()
    if n:
        _copy_kernel[(triton.cdiv(n, _BLOCK),)](src, dst, n, BLOCK=_BLOCK)
    return dst
