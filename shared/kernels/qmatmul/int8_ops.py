"""Byte-level integer operations for the int8-activation GEMV (``packed_int8``): PTX where the
kernel is compiled for a GPU, the same results from plain integer arithmetic under the Triton
interpreter (which cannot run inline assembly).

- ``dp4a``: the four bytes of a times the four signed bytes of b, summed into c (one
  instruction: ``dp4a``); a's bytes unsigned (``SIGNED_A`` 0) or signed. ``dot4``: the same
  into zero.
- ``transpose4``: a 4 x 4 byte transpose of four words, (w0, w1, w2, w3) -> (B0, B1, B2, B3) with
  byte t of Bb = byte b of wt (eight ``prmt``).
- ``even_odd``: the even bytes (0, 2, 4, 6) and the odd bytes of a 64-bit pair (lo, hi) as two
  words (two ``prmt``).

Every function is elementwise over int32 tensors of one shape. References: the interpreter
branches, which tests/test_kernel_packed_int8.py checks against numpy.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _byte(w, B: tl.constexpr):
    return (w >> (8 * B)) & 0xFF


@triton.jit
def _sbyte(w, B: tl.constexpr):
    return (((w >> (8 * B)) & 0xFF) ^ 0x80) - 0x80


@triton.jit
def dp4a(a, b, c, SIGNED_A: tl.constexpr, INTERPRETED: tl.constexpr):
    """c + sum_t byte_t(a) * signed byte_t(b) (int32)."""
    if INTERPRETED:
        for t in tl.static_range(4):
            if SIGNED_A:
                c += _sbyte(a, t) * _sbyte(b, t)
            else:
                c += _byte(a, t) * _sbyte(b, t)
        return c
    if SIGNED_A:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def dot4(a, b, SIGNED_A: tl.constexpr, INTERPRETED: tl.constexpr):
    """sum_t byte_t(a) * signed byte_t(b) (int32): dp4a with a zero accumulator in the
    instruction (no register to clear)."""
    if INTERPRETED:
        return dp4a(a, b, tl.zeros_like(a), SIGNED_A, True)
    if SIGNED_A:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
        )
    return tl.inline_asm_elementwise(
        "dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _gather(w0, w1, w2, w3, B: tl.constexpr):
    """Byte B of each word, in order, as one word."""
    return _byte(w0, B) | (_byte(w1, B) << 8) | (_byte(w2, B) << 16) | (_byte(w3, B) << 24)


@triton.jit
def transpose4(w0, w1, w2, w3, INTERPRETED: tl.constexpr):
    """(B0, B1, B2, B3): byte t of Bb is byte b of wt."""
    if INTERPRETED:
        return (
            _gather(w0, w1, w2, w3, 0),
            _gather(w0, w1, w2, w3, 1),
            _gather(w0, w1, w2, w3, 2),
            _gather(w0, w1, w2, w3, 3),
        )
    # prmt d, a, b, sel: byte k of d is byte (sel nibble k) of the pair {b: 7..4, a: 3..0}
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t0, t1, t2, t3;
        prmt.b32 t0, $4, $5, 0x5140;
        prmt.b32 t1, $6, $7, 0x5140;
        prmt.b32 t2, $4, $5, 0x7362;
        prmt.b32 t3, $6, $7, 0x7362;
        prmt.b32 $0, t0, t1, 0x5410;
        prmt.b32 $1, t0, t1, 0x7632;
        prmt.b32 $2, t2, t3, 0x5410;
        prmt.b32 $3, t2, t3, 0x7632;
        }""",
        "=r,=r,=r,=r,r,r,r,r",
        [w0, w1, w2, w3],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def even_odd(lo, hi, INTERPRETED: tl.constexpr):
    """(bytes 0, 2, 4, 6; bytes 1, 3, 5, 7) of the 64-bit value hi:lo, each as one word."""
    if INTERPRETED:
        return _gather(lo, lo >> 16, hi, hi >> 16, 0), _gather(lo, lo >> 16, hi, hi >> 16, 1)
    return tl.inline_asm_elementwise(
        """{
        prmt.b32 $0, $2, $3, 0x6420;
        prmt.b32 $1, $2, $3, 0x7531;
        }""",
        "=r,=r,r,r",
        [lo, hi],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )
