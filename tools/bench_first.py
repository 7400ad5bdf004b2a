"""The weights-first decode-batch GEMM (``packed_gemm_first``) against what the engine runs for
the same shape and against cuBLAS on a bf16 copy, at decode batch sizes.

    python -m tools.bench_first [--types Q4_K Q6_K Q8_0] [--m 16 64] [--sweep] [--fj 2 4]
        [--i8 2 3]   # also the int8 weights-first GEMM (packed_gemm8) at these stage counts

Per type, Llama-3-8B shape and M it prints µs per call, replayed from a CUDA graph with the
weight cold in L2 (``timing``): cuBLAS on bf16 copies (what batches of more than 16 rows run
where the engine keeps dense copies), the engine's config for a packed weight without them (the
shipped table's entry, else ``default_config``), and ``first_config``'s tiles. ``--sweep`` also
times the weights-first GEMM over tile sizes, stages and split counts, ``--fj`` with that many
fields a dot; ``--i8`` the int8 GEMM (``I8``: 64 weight rows, 16 or 64 activation rows a
program). Every weights-first result is checked against ``x @ unpack(pw).T`` first (the int8
GEMM's to 2 % of the largest output: its activations are rounded to int8). Weights are
row-interleaved, as CUDA layers of the int8 types keep them.
"""

from __future__ import annotations

import argparse

import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed_matmul import first_config, packed_matmul
from shared.kernels.qmatmul.timing import cold_dense_ms, cold_graph_ms
from shared.kernels.qmatmul.tuning import Tuner
from tools.bench_qgemv import interleaved_cases

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096))
# (BLOCK_N, num_warps, num_stages) x split counts for --sweep
SWEEP = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 2), (128, 8, 3))
SPLITS = (1, 2, 4)


def _checked_us(x, pw, copies, cfg, want, tol: float = 1e-4) -> float:
    """µs per call of cfg, or inf when it fails or differs from want (x @ the rounded weight.T,
    float64) by more than tol of want's largest value."""
    try:
        got = packed_matmul(x, pw, torch.float32, config=cfg)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        if err > tol:
            print(f"    WRONG {cfg}: relative error {err:.1e}")
            return float("inf")
        return cold_graph_ms(x, copies, cfg) * 1e3
    except Exception as exc:  # noqa: BLE001 - a tile this device cannot build: skip it
        print(f"    {cfg} failed: {type(exc).__name__}: {str(exc)[:160]}")
        return float("inf")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    p.add_argument("--m", nargs="+", type=int, default=[16, 64])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--fj", nargs="*", type=int, default=[], help="also first_config with FJ")
    p.add_argument("--i8", nargs="*", type=int, default=[], help="the int8 GEMM at these stages")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    tuner = Tuner(device)
    print(f"{torch.cuda.get_device_name()}: µs per call (weight cold, graph-replayed)")
    for name, n, k, pw, copies, dense in interleaved_cases(args.types, SHAPES):
        qt = T[name]
        for m in args.m:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            cublas = cold_dense_ms(x, dense) * 1e3
            want = x.double() @ dense[0].double().T
            engine_cfg = tuner.config(pw, m, x.dtype)
            engine = cold_graph_ms(x, copies, engine_cfg) * 1e3
            first_cfg = first_config(m, n, device, qt)
            first = _checked_us(x, pw, copies, first_cfg, want)
            gbs = pw.nbytes / first / 1e3
            print(f"{name} {n}x{k} m={m}: cuBLAS on copy {cublas:7.1f}  engine {engine:7.1f} "
                  f"{engine_cfg}  first_config {first:7.1f} ({gbs:.0f} GB/s) "
                  f"{first_cfg}", flush=True)  # fmt: skip
            for fj in args.fj:
                us = _checked_us(x, pw, copies, {**first_cfg, "FJ": fj}, want)
                print(f"    FJ={fj}: {us:7.1f}", flush=True)
            for stages in args.i8:
                cfg = {"I8": 1, "BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64,
                       "num_warps": 4, "num_stages": stages}  # fmt: skip
                us = _checked_us(x, pw, copies, cfg, want, tol=2e-2)
                print(f"    I8 {stages} stages: {us:7.1f} ({pw.nbytes / us / 1e3:.0f} GB/s)",
                      flush=True)  # fmt: skip
            if not args.sweep:
                continue
            cells = []
            for bn, warps, stages in SWEEP:
                for s in SPLITS:
                    cfg = {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": bn,
                           "num_warps": warps, "num_stages": stages, "SPLIT_K": s,
                           "FIRST": 1}  # fmt: skip
                    cells.append(f"{bn}/{warps}/{stages}/s{s} "
                                 f"{_checked_us(x, pw, copies, cfg, want):.1f}")  # fmt: skip
            print("    " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
