"""RoPE and the KV-cache write in the batch-1 Q/K/V GEMV's epilogue (no launch of their own).

At batch 1 a layer's Q/K/V GEMV (``packed_int8_rows``, or ``packed_int8_pair`` for Q4_K_M's
q/k beside a Q6_K v) is followed by ``rope_kv.rope_and_write_kv``: one more launch that
rotates q and k and writes k and v to the paged cache, about 2 µs a layer of exposed time on
the H200 (BENCHMARKS.md (ag)). Here the program that holds a row tile's finished sums (the
last of its splits, ``split_tickets.tile_sums``) does that work itself: its 32 rows are
consecutive features of one head (q, k and v rows of the fused weight, in that order, each
region a whole number of heads), and in the "norm" RoPE layout (GGUF's Llama) a rotated pair
is two neighbouring rows, so the tile holds both halves of each of its pairs. q rows are
rotated into the GEMV's output; k rows are rotated and v rows copied into the cache at the
token's slot (they are not stored in the output).

The values are the two launches': each sum is rounded to the output dtype as the GEMV stores
it, rotated in float32 with the angles of ``rope_kv.rope_cos_sin`` and rounded as
``rope_and_write_kv`` rounds them (tests/test_kernel_qkv_rope.py). Where the epilogue does
not apply the callers keep the two launches: the "neox" layout (a pair 64 rows apart), FP8
caches (a scale per head spans four tiles), QK-norm, biases, more than one token, and q
weights of a type it made slower on the H200 (Q6_K: ``linear.QKV_ROPE_SKIP_TYPES``).
On the H200 W1 gained 1.6 % (Q4_K_M) and 2.1 % (Q8_0) with it (BENCHMARKS.md (aj)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shared.kernels.qmatmul.split_tickets import release_tile, tile_sums
from shared.kernels.rope_kv import rope_cos_sin
from shared.kernels.rounding import to_dtype

__all__ = ["QKVRope", "finish_qkv_rope", "no_rope_args", "qkv_angles"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # outputs and caches


@dataclass(frozen=True)
class QKVRope:
    """Where a Q/K/V GEMV's epilogue puts its rows: q rotated in the output, k rotated and v
    into one layer's paged caches ([blocks, block_size, n_kv_heads, head_dim], contiguous) at
    the token's slot (< 0: not written). RoPE as ``rope_and_write_kv`` takes it ("norm")."""

    positions: torch.Tensor  # [1] int64
    slot_mapping: torch.Tensor  # [1] int64
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    n_heads: int
    rope_dim: int
    base: float
    scale: float = 1.0
    freq_factors: torch.Tensor | None = None  # [rope_dim // 2]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.k_cache.shape[2] * self.head_dim

    def refusal(self, dtype: torch.dtype) -> str | None:
        """Why the epilogue cannot take outputs of `dtype` for these caches, or None."""
        kc, vc = self.k_cache, self.v_cache
        if kc.dtype not in _FLOAT_DTYPES or vc.dtype != kc.dtype or vc.shape != kc.shape:
            return f"caches {kc.dtype} {tuple(kc.shape)}, {vc.dtype} {tuple(vc.shape)}"
        if not (kc.is_contiguous() and vc.is_contiguous()):
            return "caches not contiguous"
        if dtype not in _FLOAT_DTYPES:
            return f"outputs {dtype}"
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim or self.head_dim % 2:
            return f"rope_dim {self.rope_dim} for head_dim {self.head_dim}"
        if self.positions.shape != (1,) or self.slot_mapping.shape != (1,):
            return f"{self.positions.shape[0]} tokens"
        ff = self.freq_factors
        if ff is not None and (ff.shape != (self.rope_dim // 2,) or not ff.is_contiguous()):
            return f"freq_factors {tuple(ff.shape)}"
        return None

    def kernel_args(self, row0: int) -> tuple:
        """The GEMV kernels' RoPE arguments for a weight whose row 0 is row `row0` of the
        fused Q/K/V rows: (positions, slots, k cache, v cache, freq factors, row0, q_dim,
        kv_dim, scale, exponent step)."""
        ff = self.freq_factors if self.freq_factors is not None else self.positions
        step = -2.0 * math.log2(self.base) / self.rope_dim
        return (
            self.positions, self.slot_mapping, self.k_cache, self.v_cache, ff, row0,
            self.q_dim, self.kv_dim, float(self.scale), step,
        )  # fmt: skip

    def constexprs(self) -> dict:
        return {
            "ROPE": True,
            "HEAD_DIM": self.head_dim,
            "ROPE_DIM": self.rope_dim,
            "HAS_FF": self.freq_factors is not None,
        }


def no_rope_args(out: torch.Tensor) -> tuple:
    """QKVRope.kernel_args' places filled for a launch without the epilogue (never read)."""
    return (out, out, out, out, out, 0, 0, 0, 1.0, 0.0)


@triton.jit
def qkv_angles(pos_ptr, ff_ptr, row0, rows, scale, exponent_step, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, HAS_FF: tl.constexpr):  # fmt: skip
    """(cos, sin) of the tile's pairs ([BLOCK_N / 2]: rows row0 + rows, by twos), computed at
    a program's start: the position is a step input, written before the step's first kernel,
    so they overlap the kernel before (PDL) instead of delaying the tile's last program."""
    ge, _ = tl.split(tl.reshape(row0 + rows, (BLOCK_N // 2, 2)))
    pairs = ((ge % HEAD_DIM) // 2).to(tl.int32)  # q and k regions are whole heads
    position = tl.load(pos_ptr)
    return rope_cos_sin(position, ff_ptr, scale, exponent_step, pairs, pairs < ROPE_DIM // 2,
                        HAS_FF)  # fmt: skip


@triton.jit
def store_qkv_rope(
    out_ptr,  # [N] in the output dtype: this weight's outputs (q rows rotated here)
    y,  # [BLOCK_N] float32: the tile's finished sums
    rows,  # [BLOCK_N] this weight's rows of the tile
    N,
    cos, sin,  # [BLOCK_N / 2] the pairs' angles (qkv_angles)
    slot_ptr, kc_ptr, vc_ptr, row0, q_dim, kv_dim,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """A row tile's sums stored as q (rotated, into out), k (rotated) and v (into the caches
    at the token's slot), by their rows' place in the fused Q/K/V rows (row0 + rows)."""
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    cache_dtype: tl.constexpr = kc_ptr.dtype.element_ty
    yb = y.to(out_dtype).to(tl.float32)  # as the GEMV stores it (store_rows)
    # the tile's pairs: even rows and the odd rows after them
    x1, x2 = tl.split(tl.reshape(yb, (BLOCK_N // 2, 2)))
    g = row0 + rows  # the rows' places in the fused Q/K/V rows
    ge, _ = tl.split(tl.reshape(g, (BLOCK_N // 2, 2)))
    turn = ((ge % HEAD_DIM) < ROPE_DIM) & (ge < q_dim + kv_dim)  # not v, nor past rope_dim
    o1 = tl.where(turn, x1 * cos - x2 * sin, x1)
    o2 = tl.where(turn, x1 * sin + x2 * cos, x2)
    o = tl.reshape(tl.join(o1, o2), (BLOCK_N,))
    # q as rope_and_write_kv returns it; k as it rounds k before the cache's dtype
    o = to_dtype(o, out_dtype, INTERPRETED)
    inside = rows < N
    tl.store(out_ptr + rows, o, mask=inside & (g < q_dim))
    slot = tl.load(slot_ptr)
    kept = inside & (slot >= 0)
    base = slot * kv_dim
    is_k = (g >= q_dim) & (g < q_dim + kv_dim)
    tl.store(kc_ptr + base + (g - q_dim), to_dtype(o.to(tl.float32), cache_dtype, INTERPRETED),
             mask=kept & is_k)  # fmt: skip
    tl.store(vc_ptr + base + (g - q_dim - kv_dim),
             to_dtype(o.to(tl.float32), cache_dtype, INTERPRETED),
             mask=kept & (g >= q_dim + kv_dim))  # fmt: skip


@triton.jit
def finish_qkv_rope(
    out_ptr, part_ptr, tickets_ptr, y, rows, N,  # as split_tickets.finish_rows takes them
    cos, sin, slot_ptr, kc_ptr, vc_ptr, row0, q_dim, kv_dim,  # as store_qkv_rope takes them
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """split_tickets.finish_rows with this epilogue as the store (tickets of program_id(0))."""
    last, acc = tile_sums(part_ptr, tickets_ptr, y, rows, N, BLOCK_N, SPLITS)
    if last:
        store_qkv_rope(out_ptr, acc, rows, N, cos, sin, slot_ptr, kc_ptr, vc_ptr, row0, q_dim,
                       kv_dim, BLOCK_N, HEAD_DIM, ROPE_DIM, INTERPRETED)  # fmt: skip
        release_tile(tickets_ptr, SPLITS)
