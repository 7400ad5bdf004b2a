"""Times the K-quant GEMV (shared/kernels/qmatmul/kquants.py) on CUDA and prints GB/s.

    python -m tools.bench_qgemv_kquants [--m 1 8 32 64] [--dtype bf16|fp16|fp32]

GB/s counts the weight bytes only (the quantized rows, read once; x and the output are small at
decode batch sizes). The same run measures the device copy bandwidth (a large device-to-device
copy, bytes read + written over time) and prints each kernel's fraction of it, the ceiling a
memory-bound GEMV can approach.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton.testing
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.kquants import KQUANT_TYPES, quant_gemv_kquant

DEVICE = "cuda"
SHAPES = [(14336, 4096), (4096, 14336)]  # (N, K): Llama-3-8B FFN up/gate and down
TYPE_SIZE = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def copy_bandwidth(n_bytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy of n_bytes, counting bytes read plus bytes written."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n_bytes / ms / 1e6


def random_raw(qtype: T, n: int, k: int) -> torch.Tensor:
    """Random quant bytes with small fp16 scales, so the outputs stay finite."""
    size = TYPE_SIZE[qtype]
    raw = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8, device=DEVICE)
    scale = torch.full((n, k // 256, 1), 1e-3, dtype=torch.float16, device=DEVICE)
    for offset in (208,) if qtype == T.Q6_K else (0, 2):
        raw[:, :, offset : offset + 2] = scale.view(torch.uint8)
    return raw.reshape(n, -1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_qgemv_kquants needs a CUDA device", file=sys.stderr)
        return 1
    dtype = DTYPES[args.dtype]
    copy_gbps = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'type':<6}{'N':>7}{'K':>7}{'M':>4}{'us':>10}{'GB/s':>9}{'of copy':>9}")
    for qtype in sorted(KQUANT_TYPES):
        for n, k in SHAPES:
            raw = random_raw(qtype, n, k)
            for m in args.m:
                x = torch.randn(m, k, device=DEVICE, dtype=dtype)
                ms = triton.testing.do_bench(
                    lambda x=x, raw=raw, qtype=qtype: quant_gemv_kquant(x, raw, qtype),
                    return_mode="median",
                )
                gbps = raw.numel() / ms / 1e6
                print(
                    f"{qtype.name:<6}{n:>7}{k:>7}{m:>4}{ms * 1e3:>10.1f}{gbps:>9.0f}"
                    f"{gbps / copy_gbps:>9.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
