"""What an L2 prefetch of a weight (shared.kernels.l2_prefetch) does for its batch-1 GEMV, on CUDA.

    python -m tools.bench_l2_prefetch [--types Q4_K Q6_K] [--wait-us 10]

Per Llama-3-8B shape (the output projection, the gated gate/up, down) and per share of the
weight asked for, a CUDA graph replays, over copies of the weight that together exceed twice the
L2: a launch that issues the prefetches and exits, a ``--wait-us`` busy wait (the latency-bound
kernels of a step, where HBM idles), then the GEMV. The GEMV's time is the graph's per copy less
that of the same graph without the GEMV; share 0 issues no prefetch (the weight cold in L2, as
in a decode step today). "warm" reads the whole weight with torch first instead: the most an L2
hit can give.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from shared.kernels.l2_prefetch import prefetch_l2, table
from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from shared.kernels.qmatmul.timing import weight_copies
from shared.model.l2_plan import _PLANES
from tools.bench_qgemv import random_weight

DEVICE = "cuda"
# (name, N, K, gated activation)
SHAPES = (("wo", 4096, 4096, 0), ("gate/up", 2 * 14336, 4096, 1), ("down", 4096, 14336, 0))
SHARES = (0.0, 0.25, 0.5, 1.0)


@triton.jit
def _prefetch_only(table_ptr, n_pieces, LANES: tl.constexpr):
    prefetch_l2(table_ptr, n_pieces, True, LANES)


def _planes(pw) -> list[torch.Tensor]:
    return [t for name in _PLANES if (t := getattr(pw, name)) is not None]


def _graph_us(copies, step, reps: int = 5) -> float:
    """Median us a copy of one replay of `step(copy)` over all copies (captured once)."""
    for w in copies[:1]:
        step(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in copies:
            step(w)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(copies))
    return statistics.median(times)


def _cycles_per_us() -> float:
    """torch.cuda._sleep's cycles a microsecond, timed."""
    torch.cuda._sleep(1_000_000)  # warm up the clocks
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1e3)


def _row(pw, act: int, cycles: int) -> list[float]:
    """us of the GEMV of pw after a prefetch of each share in SHARES, then after a warm read."""
    copies = weight_copies(pw)
    x = torch.randn(1, pw.shape[1], device=DEVICE, dtype=torch.bfloat16)
    tables = {
        s: [table([(t, int(t.numel() * t.element_size() * s)) for t in _planes(w)]) for w in copies]
        for s in SHARES
    }
    which = {id(w): i for i, w in enumerate(copies)}

    def step(w, share, gemv=True, warm=False):
        tab = tables[share][which[id(w)]]
        if warm:
            for t in _planes(w):
                t.view(torch.uint8).max()
        elif tab is not None:
            _prefetch_only[(64,)](tab, tab.shape[1], LANES=128, num_warps=4)
        torch.cuda._sleep(cycles)
        if gemv:
            packed_matmul(x, w, act=act)

    row = []
    for s in SHARES:
        base = _graph_us(copies, lambda w, s=s: step(w, s, gemv=False))
        row.append(_graph_us(copies, lambda w, s=s: step(w, s)) - base)
    base = _graph_us(copies, lambda w: step(w, 0.0, gemv=False, warm=True))
    row.append(_graph_us(copies, lambda w: step(w, 0.0, warm=True)) - base)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"])
    parser.add_argument("--wait-us", type=float, default=10.0)
    args = parser.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    cycles = int(args.wait_us * _cycles_per_us())
    print(f"{props.name}, L2 {props.L2_cache_size >> 20} MB, wait {args.wait_us} us")
    print(
        f"{'type':<6}{'shape':<9}{'MB':>7}  " + "".join(f"{s:>9.2f}" for s in SHARES) + "     warm"
    )
    for name in args.types:
        qtype = T[name]
        for label, n, k, act in SHAPES:
            pw = interleave(pack(random_weight(qtype, n, k), qtype, (n, k)))
            row = _row(pw, act, cycles)
            mb = pw.nbytes / 2**20
            print(f"{name:<6}{label:<9}{mb:>7.1f}  " + "".join(f"{u:>9.2f}" for u in row),
                  flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
