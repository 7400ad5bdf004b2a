"""Casting a kernel's float32 values to the output dtype the way the GPU does, under the
Triton interpreter too: its float32 -> bfloat16 cast truncates, so bfloat16 is rounded to nearest
even by hand there (the GPU's conversion already does). Shared by every kernel that stores or
multiplies in bfloat16; ``fp16_range`` by those that form fp16 operands from wider values."""

from __future__ import annotations

import triton
import triton.language as tl

FP16_MAX = tl.constexpr(65504.0)


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


@triton.jit
def fp16_range(x):
    """float32 x clamped to fp16's finite range, so that a cast to fp16 saturates instead of
    giving infinities."""
    return tl.minimum(tl.maximum(x, -FP16_MAX), FP16_MAX)
