"""Casting a kernel's float32 values to the output dtype the way the GPU does, under the
Triton interpreter too: its float32 -> bfloat16 cast truncates, so bfloat16 is rounded to nearest
even by hand there (the GPU's conversion already does). Shared by every kernel that stores or
multiplies in bfloat16."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """float32 -> float32 holding the nearest-even bfloat16 value (exactly castable after)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """x.to(dtype), rounded to nearest even for float32 -> bfloat16 under the interpreter."""
    if INTERPRETED and x.dtype == tl.float32 and dtype == tl.bfloat16:
        x = round_bf16(x)
    return x.to(dtype)
