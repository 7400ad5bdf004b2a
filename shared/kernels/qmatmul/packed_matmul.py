"""``x @ W.T`` for a packed quantized weight W (``shared.kernels.qmatmul.packed``), in Triton.

``packed_matmul`` picks the kernel by the number of activation rows and the tile config:

- ``packed_gemv_plain`` (one activation row, decode at batch 1): a program owns ``BLOCK_N``
  weight rows, multiplies each dequantized chunk by the activations on the FMA units, split-K
  when the row tiles alone cannot fill the device (``split_tickets``). ``FACTOR``:
  the factored GEMV of ``packed_gemv``; ``INT8``: activations rounded to int8 and integer dot
  products (``packed_int8``; an approximation within the int8 rounding's bound, as llama.cpp's
  MMVQ).
- the GEMM of ``packed_gemm`` (two rows and up: decode batches and prefill), or ``DEQUANT``: a
  dense copy (``packed_dequant``) and torch's matmul.
- a weight with row-interleaved planes (``packed_rows``, the CUDA layout of the int8 types):
  one row runs ``packed_int8_rows`` (a thread a row; ``ROWS`` configs), 2 .. ``BATCH_ROWS``
  (4) rows ``packed_int8_rows_batch`` (its program over several rows), more rows the GEMMs
  above, which read either layout.

Tile sizes come from ``shared.kernels.qmatmul.tuning`` (per device, measured, cached on disk).
Reference: ``x @ unpack(pw).T`` (tests/test_kernel_packed_matmul.py).
"""

from __future__ import annotations

import torch
import triton
from gguf import GGMLQuantizationType

from shared.kernels.device import interpreted, num_sms, resident_programs
from shared.kernels.qmatmul.layout import CHUNK, INT8_TYPES, ROWS, ROWS_TYPES, PackedWeight
from shared.kernels.qmatmul.packed_chunk import MAGIC
from shared.kernels.qmatmul.packed_dequant import dequantize_packed
from shared.kernels.qmatmul.packed_gemm import (
    SMALL_TILE,
    auto_split,
    fields,
    launch_gemm,
    planes,
    strides,
    sum_splits_kernel,
)
from shared.kernels.qmatmul.packed_gemm16 import F16_TYPES, launch_gemm16
from shared.kernels.qmatmul.packed_gemm_first import launch_gemm_first
from shared.kernels.qmatmul.packed_gemv import gemv_factored_kernel, prepare_x_kernel
from shared.kernels.qmatmul.packed_gemv_plain import gemv_kernel
from shared.kernels.qmatmul.packed_int8 import launch_int8
from shared.kernels.qmatmul.packed_int8_rows import launch_int8_rows
from shared.kernels.qmatmul.packed_int8_rows_batch import (
    batch_config,
    launch_int8_rows_batch,
    takes,
)
from shared.kernels.qmatmul.packed_int8_tile import launch_int8_tile
from shared.ops.activation import gelu_mul, silu_mul

__all__ = ["config_for", "int8_rows", "packed_matmul", "rounds_gated"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def packed_matmul(
    x: torch.Tensor,
    pw: PackedWeight,
    out_dtype: torch.dtype | None = None,
    config: dict[str, int] | None = None,
    act: int = 0,
    dense: torch.Tensor | None = None,
    int8: tuple[torch.Tensor, ...] | None = None,
    out_int8: tuple | None = None,
    rope: tuple | None = None,
    norm_out: tuple | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ unpack(pw).T`` -> ``[M, N]``; x: ``[M, K]`` fp32/fp16/bf16 with unit last stride.
    ``out``: for the rows GEMV (one row over interleaved planes) only, a contiguous float
    ``[1, N]`` it stores into, in out's dtype (in place of out_dtype).

    act 1 (SiLU) or 2 (GELU, tanh approximation): the rows of pw are gate/up pairs (row 2i the
    gate of output i, 2i + 1 its up) and the result is ``act(gate) * up``, ``[M, N / 2]``,
    computed from the float32 accumulators in the kernel's epilogue (no [M, N] intermediate).

    config overrides the tiling. M = 1: ``BLOCK_N``, ``num_warps``, ``SPLIT_K`` and ``UNROLL`` (1:
    each program's chunk loop unrolled at compile time) or ``FACTOR`` (1: the factored GEMV of
    ``packed_gemv``) or ``INT8`` (1: int8 activations and dp4a, ``packed_int8``; types outside
    ``INT8_TYPES`` take the float GEMV; ``TPR`` threads a row, or ``TILE`` 1: a program's rows and
    ``CH`` chunks (default 8; the split follows) as one coalesced tile, ``packed_int8_tile``). M >
    1: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``, ``SPLIT_K`` and ``WIDE`` (one dot a
    chunk) or ``FIRST`` (16-bit x: the weights as the dot's first operand, a field a dot,
    ``packed_gemm_first``) or ``F16`` (Q4_K, Q6_K: the weights formed in fp16,
    ``packed_gemm16``), or ``DEQUANT`` (1: a dense copy of the weight in x's dtype, then torch's
    matmul). An absent ``SPLIT_K`` splits K when the tiles leave SMs idle. ``dense``: that copy made
    once and kept (``[N, K]`` in x's dtype):
    ``DEQUANT`` multiplies by it instead of dequantizing each call. ``int8``: for the rows
    GEMVs (interleaved planes: M = 1, or the batch rows GEMV's few rows), x already rounded to
    int8 for pw's layout (xq, xd, xs as ``int8_activations.prepare_int8`` returns them);
    ignored by every other path.
    ``out_int8``: (xq, xd, xs, W, G), for the rows GEMV with ``act`` only (see
    ``rounds_gated``): buffers (``int8_activations.int8_buffers_for``) the gated outputs are
    also rounded into, in layout (W, G), for the GEMV that reads them next.
    ``rope``: (``qkv_rope.QKVRope``, the fused Q/K/V row of pw's row 0), for the rows GEMV of
    Q/K/V rows without act only: its epilogue rotates the q rows in the result and writes k
    (rotated) and v to the cache instead of the result.
    ``norm_out``: a ``norm_ahead.NormOut``, for the rows GEMV without act or rope only: the
    result plus its residual is also stored as the new residual, and normed and rounded to
    int8 for the GEMVs after it (their ``int8`` of five, awaiting the norm's scale).
    """
    n, k = pw.shape
    if out_int8 is not None and not (act and rounds_gated(n // 2, *out_int8[3:])):
        raise ValueError(f"packed_matmul: out_int8 layout {out_int8[3:]} for act {act}, N={n}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"packed_matmul: x must be [M, {k}] float, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if act not in ACTS or (act and n % 2):
        raise ValueError(f"packed_matmul: act {act} for N={n} (0, 1 or 2; gate/up pairs)")
    out_dtype = out_dtype or x.dtype
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n // 2 if act else n), dtype=out_dtype, device=x.device)
    elif not (
        pw.rows32 and m == 1 and not act and out.shape == (1, n) and out.is_contiguous()
        and out.dtype in _FLOAT_DTYPES and out.device == x.device
    ):  # fmt: skip
        raise ValueError(
            f"packed_matmul: out {tuple(out.shape)} {out.dtype} for M={m}, N={n}: a contiguous "
            "float [1, N] for the rows GEMV only"
        )
    if m == 0 or n == 0:
        return out
    n_chunks = k // CHUNK[pw.qtype]
    cfg = config or config_for(pw, m, x.dtype)
    interp = interpreted(gemv_kernel)
    if rope is not None and not (pw.rows32 and m == 1 and not act):
        raise ValueError("packed_matmul: rope needs the rows GEMV (one row, interleaved, no act)")
    if norm_out is not None and not (pw.rows32 and m == 1 and not act and rope is None):
        raise ValueError("packed_matmul: norm_out needs the rows GEMV (one row, interleaved)")
    if pw.rows32 and m == 1:  # row-interleaved planes: the rows GEMV (packed_int8_rows)
        if pw.qtype not in ROWS_TYPES:
            raise ValueError(f"packed_matmul: no GEMV over interleaved {pw.qtype.name} planes")
        _rows_gemv(x, pw, out, n_chunks, cfg, act, interp, int8, out_int8, rope, norm_out)
        return out
    if out_int8 is not None:
        raise ValueError("packed_matmul: out_int8 needs the rows GEMV (one row, interleaved)")
    if pw.rows32 and cfg.get("ROWS"):  # a few rows: the rows GEMV a row group
        launch_int8_rows_batch(x, pw, out, cfg, act, interp, int8)
        return out
    if pw.rows32 and not (cfg.get("DEQUANT") or "BLOCK_M" in cfg):
        raise ValueError(f"packed_matmul: config {cfg} cannot read interleaved planes")
    if m == 1:
        tiles = triton.cdiv(n, cfg["BLOCK_N"])
        int8 = cfg.get("INT8") and pw.qtype in INT8_TYPES  # int8 activations, dp4a
        if int8 and cfg.get("TILE"):  # one coalesced tile of CH chunks a program
            splits = triton.cdiv(n_chunks, cfg.get("CH", 8))
        else:
            splits = cfg.get("SPLIT_K") or auto_split(tiles, x.device, per_sm=4, most=8)
        per_split, splits, targets = split_targets(out, pw, n_chunks, splits)
        unroll = per_split if cfg.get("UNROLL") else 0
        grid = (tiles, splits)
        if int8:
            launch = launch_int8_tile if cfg.get("TILE") else launch_int8
            launch(x, pw, targets, grid, n_chunks, per_split, cfg, act, interp)
        elif cfg.get("FACTOR"):  # codes times activations summed first, scaled once a sub-block
            xf = torch.empty(k, dtype=torch.float32, device=x.device)
            xs = torch.empty(k // 4, dtype=torch.float32, device=x.device)
            prepare_x_kernel[(triton.cdiv(k, 1024),)](x, xf, xs, k, V=4, BLOCK=1024)
            gemv_factored_kernel[grid](
                xf, xs, *planes(pw), *targets, n, n_chunks, per_split, *strides(pw), MAGIC,
                **fields(pw), BLOCK_N=cfg["BLOCK_N"], SPLITS=splits, V=4, ACT=act,
                INTERPRETED=interp, num_warps=cfg.get("num_warps", 4),
            )  # fmt: skip
        else:
            gemv_kernel[grid](
                x, *planes(pw), *targets, n, n_chunks, per_split, *strides(pw), MAGIC,
                **fields(pw), BLOCK_N=cfg["BLOCK_N"], SPLITS=splits, UNROLL=unroll, ACT=act,
                INTERPRETED=interp, num_warps=cfg.get("num_warps", 4),
            )  # fmt: skip
        return out
    if cfg.get("DEQUANT"):  # prefill sizes: one pass to a dense copy, then the dense matmul
        if dense is not None and (dense.shape != (n, k) or dense.dtype != x.dtype):
            raise ValueError(f"packed_matmul: dense must be [{n}, {k}] {x.dtype}")
        w = dense if dense is not None else dequantize_packed(pw, x.dtype)
        if out.dtype != x.dtype:  # another result dtype: the product in float32, not rounded
            x, w = x.float(), w.float()  # to x's dtype first (the tuner's float32 reference)
        if act:  # one launch reads the interleaved gate/up product and writes act(gate) * up
            y = x @ w.T
            grid = (triton.cdiv(out.numel(), 1024),)
            sum_splits_kernel[grid](y, out, out.numel(), SPLITS=1, BLOCK=1024, ACT=act)
        elif out.dtype == x.dtype:
            torch.matmul(x, w.T, out=out)
        else:
            out.copy_(x @ w.T)
        return out
    if cfg.get("F16") and pw.qtype in F16_TYPES:  # fp16 weights in registers (packed_gemm16)
        launch_gemm16(x, pw, out, cfg, interp, act)
        return out
    if cfg.get("FIRST") and x.dtype in (torch.float16, torch.bfloat16):  # packed_gemm_first
        launch_gemm_first(x, pw, out, cfg, interp, act)
        return out
    try:
        launch_gemm(x, pw, out, cfg, interp, act)
    except triton.runtime.errors.OutOfResources:
        launch_gemm(x, pw, out, SMALL_TILE, interp, act)  # a tile tuned for another dtype
    return out


def config_for(pw: PackedWeight, m: int, dtype: torch.dtype) -> dict[str, int]:
    """The config of m rows of pw without a tuned entry: the batch rows GEMV where it
    ``takes`` them (``packed_int8_rows_batch``: 2-4 rows of interleaved planes), else
    ``default_config``."""
    if takes(pw, m):
        return batch_config(pw, m)
    return default_config(m, pw.shape[0], pw.shape[1], pw.q.device, pw.qtype, dtype=dtype)


def int8_rows(pw: PackedWeight, m: int) -> bool:
    """Whether m rows of pw run an int8 rows GEMV by default, their activations rounded to int8
    first: one row of interleaved planes (``packed_int8_rows``) or the 2-4 that the batch rows
    GEMV ``takes``."""
    return pw.rows32 and m == 1 or takes(pw, m)


def rounds_gated(n_out: int, w: int, g: int) -> bool:
    """Whether the rows GEMV can round its n_out gated outputs in layout (w, g): sub-blocks of
    one or two row tiles' outputs (16 a tile), whole chunks."""
    return w in (ROWS // 2, ROWS) and n_out % (w * g) == 0


def _rows_gemv(x, pw, out, n_chunks, cfg, act, interp, int8=None, out_int8=None,
               rope=None, norm_out=None) -> None:  # fmt: skip
    """The int8 GEMV over row-interleaved planes (packed_int8_rows): a tile of 32 rows a
    program, cfg's SPLIT_K programs along K (automatic when absent), num_warps chunks in
    flight; a config of another kernel (no ``ROWS`` key: an untuned shape) takes 4 warps."""
    tiles = triton.cdiv(pw.shape[0], ROWS)
    cfg, splits = rows_plan(pw, cfg)
    per_split, splits, targets = split_targets(out, pw, n_chunks, splits)
    launch_int8_rows(x, pw, targets, (tiles, splits), n_chunks, per_split, cfg, act, interp, int8,
                     out_int8, rope, norm_out)  # fmt: skip


def rows_plan(pw: PackedWeight, cfg: dict, pair: PackedWeight | None = None) -> tuple[dict, int]:
    """The rows GEMV's (config, split count) for pw from a resolved config: a config of
    another kernel (no ``ROWS`` key: an untuned shape) takes ``wide_plan``'s unsplit programs
    where they fit (pair: a second weight in the same launch, ``packed_int8_pair``), else 4
    warps; the split is ``SPLIT_K`` or ``default_rows_split``."""
    if not cfg.get("ROWS"):
        wide = wide_plan(pw, pair)
        if wide is not None:
            return {"ROWS": 1, "num_warps": wide, "MAXNREG": WIDE_MAXNREG}, 1
        cfg = {"ROWS": 1, "num_warps": 4}
    return cfg, cfg.get("SPLIT_K") or default_rows_split(pw)


# untuned batch-1 rows GEMVs whose programs can load all their chunks at once run unsplit
# (wide_plan), capped at WIDE_MAXNREG registers a thread: two 16-warp programs an SM, so the
# 192 row tiles of Llama-3-8B's fused Q/K/V fit one wave too (sm_90: every int8 type compiles
# one pass of 16 chunks at 64 without spills; tools/kernel_sass). H200, W1 Q4_K_M
# (BENCHMARKS.md 2026-12-02 (ak)): +1.0-1.1 %, all of it from the 4096 x 4096 output
# projection's 128 programs of 16 warps (the Q/K/V's unsplit form changed nothing, at 72
# registers it stays split); unsplit programs that walk their chunks in two or more passes
# (Q/K/V in 8 warps, down in 16) lost 4.4 %. At 72 registers (one 16-warp program an SM) the
# Q/K/V's 192 row tiles no longer fit one wave and stay split, the output projection's 128
# stay unsplit: W1 Q4_K_M against 64, two rounds in each of three calls, +0.3 / +0.3 % and
# +0.2 / +0.5 % ((an)), +0.3 % ((am)); Q6_K -0.1 / +0.3 %, Q8_0 +0.0 / +0.0 % (no wide
# shapes there: their 4096 x 4096 rows take 32 chunks)
WIDE_MAXNREG = 72
_WIDE_WARPS = (8, 16)


def wide_plan(pw: PackedWeight, pair: PackedWeight | None = None) -> int | None:
    """Warps a program for an unsplit batch-1 rows GEMV of pw (and pair, in the same launch:
    of the same chunk count) on its CUDA device (``wide_warps`` at WIDE_MAXNREG registers);
    None off CUDA."""
    if pw.q.device.type != "cuda":
        return None
    weights = (pw,) if pair is None else (pw, pair)
    chunks = {w.shape[1] // CHUNK[w.qtype] for w in weights}
    if len(chunks) != 1:
        return None
    sms = num_sms(pw.q.device)
    return wide_warps(
        sum(triton.cdiv(w.shape[0], ROWS) for w in weights),
        chunks.pop(),
        # shared memory: the cross-warp sum's 128 bytes a warp (2 KB at 16, tools/kernel_sass)
        lambda warps: resident_programs(pw.q.device, WIDE_MAXNREG, warps, 128 * warps) * sms,
    )


def wide_warps(tiles: int, n_chunks: int, slots) -> int | None:
    """n_chunks warps a program (a chunk each, all requested before the program waits for its
    activations) where that count is one of _WIDE_WARPS and all `tiles` row tiles' programs
    are resident at once (slots(warps): the programs the device holds), so that the GEMV
    needs no split-K partials and tickets; else None."""
    if n_chunks in _WIDE_WARPS and tiles <= slots(n_chunks):
        return n_chunks
    return None


def split_targets(out, pw, n_chunks: int, splits: int) -> tuple[int, int, tuple]:
    """A GEMV's split-K: (chunks a split, splits without an empty one, the targets finish_rows
    takes: out, the float32 partials (out itself without splits: never read), the tickets)."""
    per_split = triton.cdiv(n_chunks, splits)
    splits = triton.cdiv(n_chunks, per_split)
    part = out
    if splits > 1:  # the last program of each row tile adds them (split_tickets)
        part = torch.empty((splits, pw.shape[0]), dtype=torch.float32, device=out.device)
    return per_split, splits, (out, part, pw.tickets)


def default_rows_split(pw: PackedWeight) -> int:
    """The rows GEMV's split for an untuned batch-1 shape (4 warps a program): about 31 warps
    an SM (the H200's Q4_K winners kept 2,000-4,000 warps in flight on its 132 SMs,
    BENCHMARKS.md 2026-11-30 (t); it beat every tuned pick inside W1's steps in (u)), at least
    four chunks a split (one a warp), at most 16 splits."""
    tiles = triton.cdiv(pw.shape[0], ROWS)
    n_chunks = pw.shape[1] // CHUNK[pw.qtype]
    target = 31 * num_sms(pw.q.device) // 4  # programs
    return max(1, min(16, target // tiles, n_chunks // 4))


# the gated activations of act= in torch (GatedLinear's fallback); the keys are the valid act
ACTS = {0: None, 1: silu_mul, 2: gelu_mul}


def default_config(
    m: int,
    n: int,
    k: int,
    device: torch.device,
    qtype: int = 0,
    block_n: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, int]:
    """Fixed tiles by M, used when no tuned entry exists for the device. For M = 1 the chunk loop
    is split until there are about four programs per SM (the H200's measured winners: 16-row
    tiles, 4 warps, 512 programs for 4096 x 4096 and 1024 x 4096), partials summed in-kernel.
    Decode batches and prefill follow the H200 sweeps of 2026-11-30 (BENCHMARKS.md): WIDE with
    32-row tiles for 17-64 rows (and for Q6_K from 2), the dense copy and torch's matmul above
    64 rows on CUDA (1.0-2.3x faster than the fused tiles at 512 rows, every 8B shape but one).
    Sweep (k) replaced WIDE by the fp16-formed weights (F16) where they won: Q6_K at 16 rows
    (all four 8B shapes, 1.06-1.18x) and 64 rows (three of four, up to 1.25x), Q4_K at 64 rows
    (all four, 1.02-1.18x); Q6_K's 2-15 rows, not swept, take the 16-row choice. F16 only for
    16-bit activations (float32 ones would be rounded to fp16). Sweep (aa) gave Q4_K and Q8_0
    at 2-64 rows to the weights-first GEMM (FIRST, ``first_config``)."""
    half = dtype in (torch.float16, torch.bfloat16)
    q4_k, q6_k = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
    if m == 1:
        split = auto_split(triton.cdiv(n, block_n), device, per_sm=4, most=8)
        return {"BLOCK_N": block_n, "SPLIT_K": split, "num_warps": 4}
    if half and m <= 64 and qtype in FIRST_TYPES and n >= FIRST_ROWS:
        return first_config(m, n, device, qtype)
    if m <= 16:
        if half and qtype == q6_k:
            return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "F16": 1}
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    if m <= 64:
        if half and qtype in (q4_k, q6_k):
            warps = 8 if qtype == q4_k else 4
            return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": warps, "num_stages": 3, "F16": 1}
        # 32-row tiles: with 64 WIDE needs 255 registers for Q4_K (kernel_sass)
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "WIDE": 1}
    if device.type == "cuda":
        return {"DEQUANT": 1}
    # 3 stages of 128 x 128 tiles exceed the H200's 227 KiB of shared memory for some types
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}


# the types the weights-first GEMM is the default for at 2-64 rows (16-bit activations, at
# least FIRST_ROWS weight rows): it beat the other packed GEMMs on the H200's Llama-3-8B shapes
# from 4096 rows up (BENCHMARKS.md (aa)), and lost at 1024 x 4096; for Q6_K the fp16 GEMM stayed
# faster. Other types were not measured.
FIRST_TYPES = frozenset({GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0})
FIRST_ROWS = 4096


def first_config(m: int, n: int, device: torch.device, qtype: int) -> dict[str, int]:
    """The weights-first GEMM's tiles (sweep (aa), 16 and 64 rows): 64 weight rows and 4 warps
    a program with K split until about four programs an SM (at most 4 splits); at 17-64 rows,
    where 128-row programs of 8 warps alone give one an SM or more (28672 x 4096), those
    unsplit.
    Q8_0's 128-element chunks take 3 stages where Q4_K's 256-element ones fit 2. The 64-row
    tiles join fields along K (FJ: 4 at 2-16 rows, 2 at 17-64; sweep (aa), 3-16 % faster on
    most shapes); the 128-row ones keep one a dot (FJ 2 took 1.4x as long there)."""
    # off CUDA (the interpreter) the sweep's device stands in: the tiles are the same
    sms = num_sms(device) if device.type == "cuda" else 132
    stages = 3 if m <= 16 or qtype == GGMLQuantizationType.Q8_0 else 2
    if m > 16 and triton.cdiv(n, 128) >= sms:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": stages,
                "SPLIT_K": 1, "FIRST": 1}  # fmt: skip
    split = min(4, triton.cdiv(4 * sms, triton.cdiv(n, 64)))
    return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64, "num_warps": 4,
            "num_stages": stages, "SPLIT_K": split, "FIRST": 1,
            "FJ": 4 if m <= 16 else 2}  # fmt: skip
