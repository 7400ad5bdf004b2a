"""Sweeps tile configs of the packed quantized matmuls on CUDA and prints the best per shape.

    python -m tools.bench_packed [--types Q4_K Q6_K Q8_0] [--m 1 16 64 512] [--quick]

Candidates are the tuner's (shared/kernels/qmatmul/tuning.py; --quick takes every third).
Decode sizes (M <= 64) report weight GB/s (packed bytes / time) against the copy bandwidth
measured in the same run (read + write), timed as a decode step runs them: replayed from a CUDA
graph with the weight cold in L2 (shared/kernels/qmatmul/timing.py). Prefill sizes report
TFLOP/s against torch's bf16 matmul of the same shape (``triton.testing.do_bench``). `GGUF
GB/s` counts the file's bytes instead (what the W1 bound uses).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton.testing
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_dequant import dequantize_packed
from shared.kernels.qmatmul.packed_gemm16 import F16_TYPES
from shared.kernels.qmatmul.packed_matmul import default_config
from shared.kernels.qmatmul.timing import cold_dense_ms, matmul_ms, weight_copies
from shared.kernels.qmatmul.tuning import INT8_TILE_TILES, INT8_TILES, candidates
from shared.quant import block_geometry
from tools.bench_qgemv import copy_bandwidth, random_weight

DEVICE = "cuda"
# (N, K) of Llama-3-8B: fused QKV, attn_output, fused gate+up, ffn_down, K or V alone, lm head
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096), (128256, 4096))


def timed(x: torch.Tensor, pw, copies, cfg: dict | None) -> float:
    try:
        return matmul_ms(x, pw, copies, cfg)
    except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: skip it
        print(f"    skipped: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}")
        return float("inf")


def families(m: int, n: int, k: int, device: torch.device, qtype: int) -> list[dict]:
    """The default tiles and one config of each alternative kernel family for this M."""
    base = default_config(m, n, k, device, qtype)
    if m == 1:
        return [
            base,
            {"BLOCK_N": 64, "num_warps": 2, "FACTOR": 1},
            {"BLOCK_N": 64, "num_warps": 4, "FACTOR": 1},
            *(
                {"BLOCK_N": b, "num_warps": w, "INT8": 1, "TPR": t, "PREFETCH": f}
                for b, w, t, f in INT8_TILES
            ),
            *(
                {"BLOCK_N": b, "num_warps": w, "INT8": 1, "TILE": 1, "CH": ch}
                for b, w, ch in INT8_TILE_TILES
            ),
            *(  # the prefetching int8 GEMVs rounding their activations in the prologue
                {"BLOCK_N": b, "num_warps": w, "INT8": 1, "TPR": t, "PREFETCH": 1, "QX": 1}
                for b, w, t, f in INT8_TILES
                if f
            ),
        ]
    if m <= 64:
        bm, stages = min(64, max(16, m)), 2 if m <= 16 else 3
        plain = {"BLOCK_M": bm, "num_warps": 4, "num_stages": stages}
        out = [base, {**plain, "BLOCK_N": 64}, {**plain, "BLOCK_N": 32, "WIDE": 1}]
        if qtype in F16_TYPES:  # fp16-formed weights (packed_gemm16)
            tile = {"BLOCK_M": min(64, max(16, m)), "num_stages": 3, "F16": 1}
            shapes = ((64, 4), (128, 4), (128, 8))
            out += [{**tile, "BLOCK_N": b, "num_warps": w} for b, w in shapes]
            # the weight tile as the dot's first operand (64-row wgmma over weight rows)
            swapped = {**tile, "SWAP": 1}
            out += [{**swapped, "BLOCK_N": b, "num_warps": w} for b, w in ((64, 4), (128, 8))]
        return out
    return [base, {"DEQUANT": 1}]


def label(cfg: dict) -> str:
    for key in ("FACTOR", "INT8", "WIDE", "F16", "DEQUANT"):
        if cfg.get(key):
            tpr = f",tpr{cfg['TPR']}" if "TPR" in cfg else ""
            tpr += f",tile{cfg['CH']}" if cfg.get("TILE") else ""
            tpr += ",qx" if cfg.get("QX") else ""
            tpr += ",pf" if cfg.get("PREFETCH") else ""
            tpr += ",swap" if cfg.get("SWAP") else ""
            return f"{key.lower()}({cfg.get('BLOCK_N', '')},{cfg.get('num_warps', '')}{tpr})"
    return f"tiles({cfg.get('BLOCK_M', 1)}x{cfg['BLOCK_N']},{cfg.get('num_warps', '')})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--m", nargs="+", type=int, default=[1, 16, 64, 512])
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="first N shapes only")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--families", action="store_true",
        help="time the default tiles beside one config of each other kernel family only",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_packed needs a CUDA device", file=sys.stderr)
        return 1
    copy = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s")
    for name in args.types:
        qtype = T[name]
        block, size = block_geometry(qtype)
        for n, k in SHAPES[: args.shapes]:
            pw = pack(random_weight(qtype, n, k), qtype, (n, k))
            copies = weight_copies(pw)
            gguf_bytes = n * k // block * size
            dense = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
            # cold dense copies for the decode-batch comparison, made once a shape
            cold = [dense] + [dense.clone() for _ in copies[1:]] if args.families else []
            for m in args.m:
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                cands = candidates(m, pw)[:: 3 if args.quick else 1]
                if args.families:
                    cands = families(m, n, k, x.device, qtype)
                results = [(timed(x, pw, copies, c), c) for c in cands]
                if args.families:  # each family's time, then the usual line
                    times = "  ".join(f"{label(c)} {t * 1e3:.1f} us" for t, c in results)
                    if 1 < m <= 64:  # what the engine runs on its dense copies (cold, graph)
                        times += f"  cuBLAS-on-copy {cold_dense_ms(x, cold) * 1e3:.1f} us"
                    print(f"{name:<5}{n:>7}{k:>6} M={m:<4} {times}")
                    if m > 64:
                        copy_fn = lambda pw=pw: dequantize_packed(pw, torch.bfloat16)  # noqa: E731
                        dq = triton.testing.do_bench(copy_fn)
                        print(f"{'':18} dense copy alone {dq * 1e3:.1f} us "
                              f"({n * k * 2 / dq / 1e6:.0f} GB/s written)")  # fmt: skip
                ms, cfg = min(results, key=lambda r: r[0])
                ms_default = timed(x, pw, copies, None)
                if m <= 64:
                    gbps = pw.nbytes / ms / 1e6
                    print(
                        f"{name:<5}{n:>7}{k:>6} M={m:<4} {ms * 1e3:8.1f} us {gbps:6.0f} GB/s "
                        f"({gbps / copy:.2f} of copy; GGUF {gguf_bytes / ms / 1e6:.0f} GB/s) "
                        f"default {ms_default * 1e3:.1f} us  best {cfg}"
                    )
                else:
                    ref = triton.testing.do_bench(lambda x=x, dense=dense: x @ dense.T)
                    flops = 2 * m * n * k
                    print(
                        f"{name:<5}{n:>7}{k:>6} M={m:<4} {ms * 1e3:8.1f} us "
                        f"{flops / ms / 1e9:6.0f} TFLOP/s (torch bf16 {flops / ref / 1e9:.0f}) "
                        f"default {ms_default * 1e3:.1f} us  best {cfg}"
                    )
                sys.stdout.flush()
            del pw, dense, copies, cold
    return 0


if __name__ == "__main__":
    sys.exit(main())
