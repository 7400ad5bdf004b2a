"""Times the int8 GEMV over row-interleaved planes (packed_int8_rows) beside the shipped batch-1
config of the plain planes, per Llama-3-8B shape, on CUDA.

    python -m tools.bench_rows [--types Q4_K Q6_K Q8_0] [--json best.json]

Both are timed as a decode step runs them (``timing.cold_graph_ms``: CUDA graph, the weight
cold in L2); GB/s counts the packed bytes, against the copy bandwidth measured in the same run.
Every rows config is checked against the plain int8 GEMV first (same rounding: the results
agree to float32 summation order). --json writes the fastest rows config per shape.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_int8_rows_policy import CACHE_HINTS, DEFAULT_CACHE
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from shared.kernels.qmatmul.timing import cold_graph_ms, weight_copies
from shared.kernels.qmatmul.tuning import ROWS_TILES, Tuner, agrees
from tools.bench_packed import SHAPES
from tools.bench_qgemv import copy_bandwidth, random_weight

DEVICE = "cuda"
# (num_warps = chunks in flight, PREFETCH, QX) x splits: the tuner's quick list (five compiles).
# Each carries ROWS: packed_matmul gives a config without it the default tile and split (so
# from eaef622 to 8e2400c every candidate here timed the default config).
ROWS_CONFIGS = [
    {"ROWS": 1, "INT8": 1, "num_warps": w, "PREFETCH": p, "QX": qx} for w, p, qx in ROWS_TILES
]
# and the default tile with the weight loads' other cache hints
# (packed_int8_rows_policy.CACHE_HINTS)
ROWS_CONFIGS += [
    {"ROWS": 1, "INT8": 1, "num_warps": 4, "PREFETCH": 0, "QX": 0, "CACHE": c}
    for c in CACHE_HINTS
    if c != DEFAULT_CACHE
]
SPLITS = (1, 2, 4, 8, 16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s (read + write)")
    tuner = Tuner(torch.device(DEVICE))
    best_rows: dict[str, dict] = {}
    head = f"{'type':<6}{'N':>7}{'K':>7}{'shipped us':>12}{'rows us':>9}{'GB/s':>7}{'of copy':>8}"
    print(head + "  speed-up  rows config")
    for name in args.types:
        qtype = T[name]
        for n, k in SHAPES:
            pw = pack(random_weight(qtype, n, k), qtype, (n, k))
            iw = interleave(pw)
            x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
            shipped_cfg = tuner.config(pw, 1, torch.bfloat16)
            ref = packed_matmul(x, pw, torch.float32, shipped_cfg)
            shipped = cold_graph_ms(x, weight_copies(pw), shipped_cfg)
            del ref
            copies = weight_copies(iw)
            exact = packed_matmul(x, pw, torch.float32, {"BLOCK_N": 64, "num_warps": 4})
            best, best_ms = None, float("inf")
            for base in ROWS_CONFIGS:
                for s in SPLITS:
                    cfg = {**base, "SPLIT_K": s}
                    try:
                        got = packed_matmul(x, iw, torch.float32, cfg)
                        if not agrees(got, exact, 2e-2):
                            print(f"    DISAGREES: {name} {n}x{k} {cfg}")
                            continue
                        ms = cold_graph_ms(x, copies, cfg)
                    except Exception as exc:  # noqa: BLE001 - report and skip
                        print(f"    skipped {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                        continue
                    if ms < best_ms:
                        best, best_ms = cfg, ms
            gbs = pw.nbytes / best_ms / 1e6
            print(
                f"{name:<6}{n:>7}{k:>7}{shipped * 1e3:>12.1f}{best_ms * 1e3:>9.1f}{gbs:>7.0f}"
                f"{gbs / (copy / 2):>8.2f}{shipped / best_ms:>9.2f}x  {best}  (shipped "
                f"{shipped_cfg})",
                flush=True,
            )
            best_rows[f"{int(qtype)}|{n}x{k}"] = {
                **(best or {}),
                "us": round(best_ms * 1e3, 2),
                "shipped_us": round(shipped * 1e3, 2),
            }
            del copies, iw, pw
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best_rows, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
