"""Per-device tile choices for the packed quantized matmuls, measured once and kept on disk.

The best config depends on the device (SM count, memory system), the weight type and shape and
the number of activation rows, so a ``Tuner`` times a few candidates per
``(device, type, N, K, M bucket)`` with ``triton.testing.do_bench`` and stores the winner in
``$SKIFF_CACHE_DIR/qmatmul-tuning.json`` (default ``~/.cache/skiff``), keyed by the device's
name and compute capability. Later loads read the file and time nothing. Unknown keys fall back
to ``packed_matmul.default_config`` (tiles sized from the SM count).

A first load times batch-1 decode only, over ``quick_candidates`` (five compiles per weight type,
plus the int8 GEMV's, shared by its shapes: seconds, not minutes); ``SKIFF_QMATMUL_TUNE=1``
times every bucket with every candidate (each candidate is a compile of its own: on the H200 one
(type, shape) took about half a minute, an 8B model many minutes) and ``0`` times nothing.
Tables measured once per kind of device ship in ``tuned/``. The model loader tunes every packed
layer shape before CUDA graphs are captured (timing cannot run inside a capture);
tools/bench_packed.py sweeps wider grids by hand. Decode-sized buckets are timed as a decode
step runs them (``timing.cold_graph_ms``: CUDA graph, weight cold in L2). A candidate is timed
only if its result agrees with the default tiles' (a variant that compiles wrong is never
picked; the int8 GEMV within its rounding, ``INT8_TOL``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import triton
import triton.testing

from shared.kernels.qmatmul.layout import CHUNK, INT8_TYPES, PackedWeight
from shared.kernels.qmatmul.packed_gemm16 import F16_TYPES
from shared.kernels.qmatmul.packed_int8_rows_batch import takes
from shared.kernels.qmatmul.packed_matmul import config_for, packed_matmul
from shared.kernels.qmatmul.timing import matmul_ms, weight_copies

__all__ = [
    "BUCKETS",
    "Tuner",
    "agrees",
    "bucket",
    "candidates",
    "device_key",
    "quick_candidates",
    "reference",
]

INT8_TOL = 2e-2
F16_TOL = 2e-3  # fp16-formed weights (packed_gemm16): one fp16 rounding of weights and inputs
# representative M of each bucket: decode 1, <= 16, <= 64, prefill
BUCKETS = (1, 16, 64, 512)
# <device>.json tables measured with this code (see tuned/README.md)
SHIPPED = Path(__file__).parent / "tuned"


def bucket(m: int) -> int:
    return next((b for b in BUCKETS[:-1] if m <= b), BUCKETS[-1])


def device_key(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}|sm{props.major}{props.minor}|{props.multi_processor_count}sm"


# the int8-activation GEMV (packed_int8): (BLOCK_N, num_warps, TPR threads a row, PREFETCH), one
# row part a thread; more threads a row coalesce the loads, fewer scale fewer sub-blocks
# (kernel_sass: Q4_K 1.4 instructions a weight with one, 2.1 with eight); PREFETCH requests the
# next chunk first (127 registers instead of 52 for Q4_K). The H200 picked TPR 1 and 2 (0b29ea5).
INT8_TILES = ((128, 4, 1, 0), (64, 4, 2, 0), (32, 4, 4, 0), (16, 4, 8, 0), (128, 4, 1, 1),
              (64, 4, 2, 1))  # fmt: skip
# the one-tile int8 GEMV (packed_int8_tile): (BLOCK_N, num_warps, CH chunks a program); full
# tuning only (SKIFF_QMATMUL_TUNE=1): it won 2 of 18 batch-1 shapes on the H200 (BENCHMARKS.md (r))
INT8_TILE_TILES = ((16, 4, 4), (16, 4, 8), (16, 4, 16), (8, 4, 16), (32, 4, 8), (32, 8, 8))


# the int8 GEMV over row-interleaved planes (packed_int8_rows): (num_warps = chunks in flight,
# PREFETCH, QX); it took 1.07-2.31x less time than the shipped configs on the H200's Q4_K 8B
# shapes (BENCHMARKS.md 2026-11-30 (t)), the winners spread over 2, 4 and 8 warps
ROWS_TILES = ((2, 0, 0), (4, 0, 0), (8, 0, 0), (4, 1, 0), (2, 1, 1))


def rows_candidates(pw: PackedWeight) -> list[dict[str, int]]:
    """Batch-1 configs of an interleaved weight: the rows GEMV's, by split (a launch
    argument: five compiles a type, each the winner of some Q4_K shape on the H200)."""
    return [
        {"ROWS": 1, "INT8": 1, "num_warps": w, "PREFETCH": p, "QX": qx, "SPLIT_K": s}
        for w, p, qx in ROWS_TILES
        for s in (1, 2, 4, 8, 16)
    ]


def quick_candidates(pw: PackedWeight) -> list[dict[str, int]]:
    """The batch-1 decode candidates a first load times by default: five compiles per type
    (shared by every shape of the type), plus the int8 GEMV's six where the type has it and
    its two prefetching ones with ``QX``; the split-K variants free. The one-tile GEMV lost on
    16 of 18 shapes in the H200 sweep of 2026-11-30 (r) and is left to the full tuning. An
    interleaved weight (``packed_rows``) has the rows GEMV only."""
    if pw.rows32:
        return rows_candidates(pw)
    tiles = [(16, 4, {}), (32, 2, {}), (32, 4, {}), (64, 2, {"FACTOR": 1}), (64, 4, {"FACTOR": 1})]
    if pw.qtype in INT8_TYPES:
        tiles += [(b, w, {"INT8": 1, "TPR": t, "PREFETCH": f}) for b, w, t, f in INT8_TILES]
        # the prefetching ones also with the activations rounded in their prologue (QX)
        tiles += [(b, w, {**e, "QX": 1}) for b, w, e in tiles if e.get("PREFETCH")]
    return [
        {"BLOCK_N": b, "SPLIT_K": s, "num_warps": w, **extra}
        for b, w, extra in tiles
        for s in (1, 2, 4, 8)
    ]


def one_tile_candidates(pw: PackedWeight) -> list[dict[str, int]]:
    """The one-tile int8 GEMV's configs (its CH sets the split), for the types it has."""
    if pw.qtype not in INT8_TYPES:
        return []
    return [
        {"BLOCK_N": b, "num_warps": w, "INT8": 1, "TILE": 1, "CH": ch}
        for b, w, ch in INT8_TILE_TILES
    ]


def candidates(m: int, pw: PackedWeight) -> list[dict[str, int]]:
    if m == 1 and pw.rows32:
        return rows_candidates(pw)
    if m == 1:
        # split-K gives each SM more programs (more loads in flight) for one partial-sum pass
        # (the split is a launch argument: four splits cost one compile)
        out = [
            {"BLOCK_N": b, "SPLIT_K": s, "num_warps": w}
            for b in (16, 32)
            for w in (2, 4)
            for s in (1, 2, 4, 8)
        ]
        # unrolled chunk loops of at most 16 chunks (each length a compile of its own), down to
        # one chunk per program: every load of a program issued at once, many programs per SM
        chunks = pw.shape[1] // CHUNK[pw.qtype]
        split = triton.cdiv(chunks, 16)
        for s in sorted({split, triton.cdiv(chunks, 4), chunks}):  # <= 16, 4 or 1 chunks each
            out += [{"BLOCK_N": b, "SPLIT_K": s, "num_warps": 2, "UNROLL": 1} for b in (16, 32)]
        # the factored GEMV (packed_gemv): one row a thread, about half the instructions a weight
        out += [
            {"BLOCK_N": b, "SPLIT_K": s, "num_warps": w, "FACTOR": 1}
            for b, w in ((64, 2), (64, 4), (128, 4))  # (32, 1) hits 255 registers for Q4_K
            for s in (1, 2, 4, 8)
        ]
        if pw.qtype in INT8_TYPES:  # int8 activations, dp4a (packed_int8)
            out += [
                {"BLOCK_N": b, "SPLIT_K": s, "num_warps": w, "INT8": 1, "TPR": t, "PREFETCH": f}
                for b, w, t, f in (*INT8_TILES, (64, 2, 1, 0), (256, 8, 1, 0), (64, 2, 1, 1))
                for s in (1, 2, 4, 8)
            ]
            out += [{**c, "QX": 1} for c in out if c.get("PREFETCH")]  # rounding in the prologue
            out += one_tile_candidates(pw)
        return out
    # decode batches: split-K is a launch argument (no compile of its own)
    # (WIDE with 32-row tiles only: with 64 it needs up to 255 registers, kernel_sass)
    # fp16-formed weights (packed_gemm16), the weight tile first in the dot (SWAP) at <= 16 rows
    swap = {"F16": 1, "SWAP": 1, "num_stages": 3}
    f16_small = [(64, 4, swap), (128, 8, swap)] if pw.qtype in F16_TYPES else []
    # the weights-first GEMM (packed_gemm_first; 16-bit activations, else the plain tiles)
    first = [(64, 4, {"FIRST": 1}), (128, 8, {"FIRST": 1})]
    if m <= 16:
        return [
            {"BLOCK_M": 16, "BLOCK_N": b, "num_warps": w, "num_stages": 2, "SPLIT_K": s, **wide}
            for b, w, wide in (
                (32, 4, {}),
                (64, 4, {}),
                (32, 4, {"WIDE": 1}),
                *f16_small,
                *first,
            )
            for s in (1, 2, 4, 8)
        ]
    if m <= 64:
        # fp16-formed weights (packed_gemm16, Q4_K / Q6_K): 64 or 128 rows a tile
        f16 = [(64, 4, {"F16": 1}), (128, 4, {"F16": 1}), (128, 8, {"F16": 1})]
        f16 += [(64, 4, {"F16": 1, "SWAP": 1}), (128, 8, {"F16": 1, "SWAP": 1})]
        return [
            {"BLOCK_M": 64, "BLOCK_N": b, "num_warps": w, "num_stages": 3, "SPLIT_K": s, **wide}
            for b, w, wide in (
                (32, 4, {}), (64, 4, {}), (64, 8, {}), (32, 4, {"WIDE": 1}),
                *(f16 if pw.qtype in F16_TYPES else ()), *first,
            )
            for s in (1, 2, 4, 8)
        ]  # fmt: skip
    return [{"DEQUANT": 1}] + [
        {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
        for bm, bn, w, s in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3))
    ]


def agrees(got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> bool:
    """Same product up to summation order (relative Frobenius error). The int8 GEMV is held to
    INT8_TOL: its activations are rounded (about 0.5 % for Gaussian ones; a wrong kernel is
    off by 100 %); the fp16 GEMM to F16_TOL (weights and activations rounded to fp16)."""
    err = (got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    return bool(torch.isfinite(got).all()) and float(err) < tol


def reference(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """The product candidates are checked against, float32: one row by the default GEMV (the
    exact weights); more rows by the dense path, whose weights are rounded to x's dtype as
    every exact GEMM rounds them. (The default tiles were the reference for every bucket, but
    at 64 rows they are the fp16-formed GEMM, about 1e-3 off: no exact candidate agreed.)"""
    config = None if x.shape[0] == 1 else {"DEQUANT": 1}
    return packed_matmul(x, pw, out_dtype=torch.float32, config=config)


def timed_buckets(pw: PackedWeight, mode: str) -> tuple[int, ...]:
    """The M buckets a load times for this weight: batch 1 by default, every one with mode "1".
    Batch 1 of an interleaved weight keeps the rows GEMV's default split: every timed pick (one
    GEMV, weight cold, graph-replayed) lost to it in the engine's decode steps on the H200 (W1
    Q6_K 243.8 against 324.5 tok/s, Q8_0 202.3 against 304.3; BENCHMARKS.md (u))."""
    buckets = BUCKETS if mode == "1" else (1,)
    return tuple(m for m in buckets if not (pw.rows32 and m == 1))


class Tuner:
    """Tile configs for one device; ``config`` is a dictionary lookup (safe inside graphs)."""

    def __init__(self, device: torch.device, cache_dir: Path | None = None) -> None:
        self.device = torch.device(device)
        root = cache_dir or Path(
            os.environ.get("SKIFF_CACHE_DIR") or Path.home() / ".cache" / "skiff"
        )
        self.path = root / "qmatmul-tuning.json"
        self.prefix = device_key(self.device) if self.device.type == "cuda" else "cpu"
        # tables measured on known devices ship with the code; the local cache overrides them
        self.table: dict[str, dict[str, int]] = {}
        for shipped in sorted(SHIPPED.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                self.table.update(json.loads(shipped.read_text()))
        with contextlib.suppress(OSError, ValueError):
            self.table.update(json.loads(self.path.read_text()))
        # config() runs on every matmul call: resolved configs by (type, shape, bucket, dtype)
        self._resolved: dict[tuple, dict[str, int]] = {}

    def table_key(self, pw: PackedWeight, m_bucket: int, dtype: torch.dtype) -> str:
        n, k = pw.shape
        # batch 1 of an interleaved weight runs another kernel: an entry of its own
        rows = "|rows" if pw.rows32 and m_bucket == 1 else ""
        return f"{self.prefix}|{int(pw.qtype)}|{n}x{k}|m{m_bucket}|{str(dtype)[6:]}{rows}"

    def config(self, pw: PackedWeight, m: int, dtype: torch.dtype) -> dict[str, int]:
        """The table's entry for m's bucket, else the default; 2 .. BATCH_ROWS rows of
        interleaved planes the batch rows GEMV (``packed_int8_rows_batch.takes``; no table
        entries of their own)."""
        batch = takes(pw, m)
        memo = (pw.qtype, pw.shape, m if batch else bucket(m), dtype, pw.rows32)
        cfg = self._resolved.get(memo)
        if cfg is None:
            found = None if batch else self.table.get(self.table_key(pw, memo[2], dtype))
            cfg = found or config_for(pw, m, dtype)
            self._resolved[memo] = cfg
        return cfg

    def set_entries(self, entries: dict[str, dict[str, int]], drop: list[str]) -> None:
        """Replace the entries of the keys in `drop` by `entries` (those not given fall back to
        the defaults) for the configs resolved from now on (tools/tune_decode.py)."""
        for key in drop:
            self.table.pop(key, None)
        self.table.update(entries)
        self._resolved.clear()

    def tune(self, pw: PackedWeight, dtype: torch.dtype) -> None:
        """Time candidates for the buckets of this weight's shape (activations of `dtype`) that
        have no entry yet: by default batch-1 decode with ``quick_candidates``;
        ``SKIFF_QMATMUL_TUNE=1`` every bucket with every candidate, ``0`` nothing."""
        mode = os.environ.get("SKIFF_QMATMUL_TUNE", "decode")
        if self.device.type != "cuda" or mode == "0":
            return
        todo = [
            m for m in timed_buckets(pw, mode) if self.table_key(pw, m, dtype) not in self.table
        ]
        if not todo:
            return
        copies = weight_copies(pw)  # cold weights for the decode-sized timings
        for m in todo:
            x = torch.randn(m, pw.shape[1], device=self.device, dtype=dtype)
            ref = reference(x, pw)
            best, best_ms = None, float("inf")
            for cfg in candidates(m, pw) if mode == "1" else quick_candidates(pw):
                try:
                    int8 = cfg.get("INT8")  # activations rounded to int8
                    tol = INT8_TOL if int8 else F16_TOL if cfg.get("F16") else 1e-4
                    if not agrees(packed_matmul(x, pw, torch.float32, cfg), ref, tol):
                        continue  # never pick a variant that computes something else
                    ms = matmul_ms(x, pw, copies, cfg)
                except Exception:  # noqa: BLE001 - a tile this device cannot build or hold
                    continue
                if ms < best_ms:
                    best, best_ms = cfg, ms
            if best is not None:
                self.table[self.table_key(pw, m, dtype)] = best
        self._resolved.clear()
        self._save()

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            mine = {k: v for k, v in self.table.items() if k.startswith(f"{self.prefix}|")}
            tmp.write_text(json.dumps(mine, indent=1, sort_keys=True))
            tmp.replace(self.path)  # atomic: concurrent workers never read half a file
        except OSError:
            pass  # a read-only cache only costs re-tuning next time
