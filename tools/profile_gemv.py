"""Runs one packed GEMV shape a few times, for a profiler (ncu) to read its counters.

    ncu --clock-control none -k regex:_gemv --launch-skip 2 --launch-count 1 \
        python -m tools.profile_gemv --type Q4_K --n 4096 --k 4096 [--config '{"BLOCK_N": 16}']

Without --config it uses the default tiles (packed_matmul.default_config); it prints the
config and the median time of a plain launch (not the cold-weight graph timing of bench_packed).
--rows interleaves the planes (packed_rows), as CUDA layers of the int8 types keep them: batch
1 then runs the rows GEMV (packed_int8_rows) with the dispatch's own config.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_matmul import default_config, packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from tools.bench_qgemv import random_weight


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="Q4_K")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--config", default=None, help="tile config as JSON")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", action="store_true", help="row-interleaved planes")
    args = parser.parse_args(argv)
    qtype = T[args.type]
    pw = pack(random_weight(qtype, args.n, args.k), qtype, (args.n, args.k))
    x = torch.randn(1, args.k, device="cuda", dtype=torch.float16)
    cfg = json.loads(args.config) if args.config else None
    if args.rows:
        pw = interleave(pw)
    elif cfg is None:
        cfg = default_config(1, args.n, args.k, x.device)
    for _ in range(args.runs):
        packed_matmul(x, pw, config=cfg)
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(lambda: packed_matmul(x, pw, config=cfg), return_mode="median")
    gbps = pw.nbytes / ms / 1e6
    print(f"{args.type} {args.n}x{args.k} {cfg}: {ms * 1e3:.1f} us ({gbps:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
