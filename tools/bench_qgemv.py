"""Times the quantized GEMV kernels on CUDA and prints weight GB/s against the copy bandwidth.

    python -m tools.bench_qgemv [--types Q4_0 Q8_0 Q4_K] [--m 1 8 32 64] [--dtype bf16]

GB/s counts the weight bytes only (x and the output are tiny at decode sizes), so the
"of copy" column says how close a kernel comes to the device's memory bandwidth, measured in
the same run as a large device-to-device copy (bytes read + written / time). Times are medians
of ``triton.testing.do_bench``. Add a quant type by adding a row to ``KERNELS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import triton.testing
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul import quant_gemv_kquant, quant_gemv_legacy
from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_rows import interleave
from shared.kernels.qmatmul.timing import dense_copies, weight_copies
from shared.quant import FP16_FIELDS, block_geometry

DEVICE = "cuda"
SHAPES = ((14336, 4096), (4096, 14336))  # (N, K): Llama-3-8B FFN up/gate and down
# type -> kernel(x [M, K], raw uint8 [N, row_bytes], qtype) -> [M, N]
KERNELS: dict[T, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    T.Q4_0: quant_gemv_legacy,
    T.Q4_1: quant_gemv_legacy,
    T.Q5_0: quant_gemv_legacy,
    T.Q5_1: quant_gemv_legacy,
    T.Q8_0: quant_gemv_legacy,
    T.Q4_K: quant_gemv_kquant,
    T.Q5_K: quant_gemv_kquant,
    T.Q6_K: quant_gemv_kquant,
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def copy_bandwidth(n_bytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy: bytes read + bytes written per second."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n_bytes / ms / 1e6


def random_weight(qtype: T, n: int, k: int) -> torch.Tensor:
    """Random blocks with small finite fp16 scales (speed does not depend on the values)."""
    block_size, type_size = block_geometry(qtype)
    raw = torch.randint(0, 256, (n * k // block_size, type_size), dtype=torch.uint8, device=DEVICE)
    for off in FP16_FIELDS[qtype]:
        scales = (torch.rand(raw.shape[0], device=DEVICE) * 1e-2).half().view(torch.uint8)
        raw[:, off : off + 2] = scales.reshape(-1, 2)
    return raw.reshape(n, -1)


def interleaved_cases(types: list[str], shapes):
    """(type name, N, K, the random weight row-interleaved, its copies for cold timings, its
    bf16 dense copies) per type and (N, K) shape, one at a time."""
    for name in types:
        qt = T[name]
        for n, k in shapes:
            pw = interleave(pack(random_weight(qt, n, k), qt, (n, k)))
            yield name, n, k, pw, weight_copies(pw), dense_copies(pw)


def bench(qtypes: list[T], ms_list: list[int], copy_gbps: float, dtype: torch.dtype) -> None:
    print(f"{'type':<6}{'N':>7}{'K':>7}{'M':>4}{'us':>9}{'GB/s':>8}{'of copy':>9}")
    for qtype in qtypes:
        kernel = KERNELS[qtype]
        for n, k in SHAPES:
            raw = random_weight(qtype, n, k)
            for m in ms_list:
                x = torch.randn(m, k, device=DEVICE, dtype=dtype)
                ms = triton.testing.do_bench(
                    lambda kernel=kernel, x=x, raw=raw, qtype=qtype: kernel(x, raw, qtype),
                    return_mode="median",
                )
                gbps = raw.numel() / ms / 1e6
                print(
                    f"{qtype.name:<6}{n:>7}{k:>7}{m:>4}{ms * 1e3:>9.1f}{gbps:>8.0f}"
                    f"{gbps / copy_gbps:>9.2f}"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=[t.name for t in KERNELS])
    parser.add_argument("--m", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_qgemv needs a CUDA device", file=sys.stderr)
        return 1
    qtypes = [T[name] for name in args.types]
    copy_gbps = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {copy_gbps:.0f} GB/s")
    bench(qtypes, args.m, copy_gbps, DTYPES[args.dtype])
    return 0


if __name__ == "__main__":
    sys.exit(main())
