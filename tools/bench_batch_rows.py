"""Times the rows GEMV over a few activation rows (``packed_int8_rows_batch``) against what
decode batches of 2-8 rows run without it and against cuBLAS on a bf16 copy, per Llama-3-8B shape.

    python -m tools.bench_batch_rows [--types Q4_K Q6_K Q8_0] [--m 2 4 8] [--mr 2 4] [--regs 128]
        [--splits 1 2 3 4]

Per type, shape and M: µs per call (CUDA graph, weight cold in L2, ``timing``) of the batch-1 rows
GEMV (one row: the floor), the decode-batch GEMM the engine took for M rows before
(``default_config``), cuBLAS on a bf16 copy, and the batch rows GEMV as shipped (``batch_config``:
marked *), with ``--mr`` rows a program (more programs sharing the weight through L2), and with
``--regs`` register caps, and at ``--splits`` K splits (``SPLIT_K``; shipped: ``batch_split``,
about 31 warps an SM whatever the registers let an SM hold). GB/s counts the packed bytes,
against the copy bandwidth measured in the same run. Every batch result is checked against
``x @ unpack(pw).T`` within the int8 rounding's bound.
"""

from __future__ import annotations

import argparse

import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed_int8_rows_batch import batch_config
from shared.kernels.qmatmul.packed_matmul import default_config, packed_matmul
from shared.kernels.qmatmul.timing import cold_dense_ms, cold_graph_ms
from shared.kernels.qmatmul.tuning import INT8_TOL, agrees
from tools.bench_qgemv import copy_bandwidth, interleaved_cases

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def _us(x, pw, copies, cfg, want) -> str:
    """µs per call of cfg and its GB/s, or why not."""
    try:
        got = packed_matmul(x, pw, torch.float32, config=cfg)
        if not agrees(got, want, INT8_TOL):
            return "WRONG"
        us = cold_graph_ms(x, copies, cfg) * 1e3
    except Exception as exc:  # noqa: BLE001 - a config this device cannot build: say so
        return f"failed ({type(exc).__name__})"
    return f"{us:7.1f} ({pw.nbytes / us / 1e3:4.0f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    p.add_argument("--m", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--mr", nargs="*", type=int, default=[2, 4])
    p.add_argument("--shapes", nargs="*", default=None, help="NxK, default the 8B shapes")
    p.add_argument("--regs", nargs="*", type=int, default=[], help="MAXNREG caps to try")
    p.add_argument("--splits", nargs="*", type=int, default=[], help="SPLIT_K counts to try")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes] if a.shapes else SHAPES
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bandwidth():.0f} GB/s; "
          "µs per call (GB/s of the packed weight), weight cold, graph-replayed")  # fmt: skip
    for name, n, k, pw, copies, dense in interleaved_cases(a.types, shapes):
        qt = T[name]
        x1 = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        one = cold_graph_ms(x1, copies, None) * 1e3
        print(f"{name} {n}x{k}: one row {one:.1f} µs ({pw.nbytes / one / 1e3:.0f} GB/s)")
        for m in a.m:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = x.double() @ dense[0].double().T
            cublas = cold_dense_ms(x, dense) * 1e3
            before = default_config(m, n, k, device, qt, dtype=x.dtype)
            cells = [f"before {_us(x, pw, copies, before, want)}", f"cuBLAS {cublas:7.1f}"]
            shipped = batch_config(pw, m)
            cells.append(f"MR={shipped['MR']}* {_us(x, pw, copies, shipped, want)}")
            for mr in (r for r in a.mr if r <= m and r != shipped["MR"]):
                cfg = {**shipped, "MR": mr}
                cells.append(f"MR={mr} {_us(x, pw, copies, cfg, want)}")
            for regs in a.regs:
                cfg = {**shipped, "MAXNREG": regs}
                cells.append(f"MR={shipped['MR']} r{regs} {_us(x, pw, copies, cfg, want)}")
            for splits in a.splits:
                cfg = {**shipped, "SPLIT_K": splits}
                cells.append(f"MR={shipped['MR']} s{splits} {_us(x, pw, copies, cfg, want)}")
            print(f"  m={m}: " + "  ".join(cells), flush=True)
        del dense, copies
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
