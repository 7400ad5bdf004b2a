"""The floor of one launch in a decode step's chain of kernels: µs a kernel of a CUDA graph of N
kernels that do nothing but wait for the one before, with and without PDL, by programs a launch.

    python -m tools.bench_launch_floor [--launches 256] [--programs 1 132 528 1056] [--replays 50]

A batch-1 decode step is a chain of about 290 launches (Q4_K_M: nine a layer, BENCHMARKS.md
(ag)/(ai)), each waiting for the whole of the one before. The kernels here keep only that: every
program waits (``gdc.wait_prev`` with PDL, else the stream's order), and program 0 stores the
previous kernel's value plus one, so the last value checks the order of the whole chain. What a
link costs here, a step pays at least once a launch, whatever its kernels compute. Beside it, a
chain of the step's commonest small kernel, the residual add + RMSNorm rounding one 4096-wide
row to int8 (``norm.add_rms_norm_int8``, 65 launches a Llama-3-8B step), each taking the one
before's output: its µs a launch less the floor is what its own work adds. Replayed from a CUDA
graph, as the engine's decode steps are.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from shared.kernels.gdc import launch_kw, launch_next, pdl, wait_prev

# int32 words between two links' values: each link's pointer stays 16-byte aligned (one
# compiled kernel for every link)
_STRIDE = 4


@triton.jit
def _link_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    launch_next(PDL)
    wait_prev(PDL)
    if tl.program_id(0) == 0:
        tl.store(dst_ptr, tl.load(src_ptr) + 1)


def chain(values: torch.Tensor, programs: int, use_pdl: bool) -> None:
    """Launches len(values) - 1 links: value i + 1 = value i + 1, each link after the one
    before (values: int32 [links + 1, _STRIDE])."""
    for i in range(values.shape[0] - 1):
        _link_kernel[(programs,)](values[i], values[i + 1], PDL=use_pdl, **launch_kw(use_pdl))


def _captured(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, launches: int, replays: int) -> float:
    """µs a launch of a graph of `launches` launches, over `replays` replays after 3."""
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * launches)


def link_us(launches: int, programs: int, use_pdl: bool, replays: int) -> float:
    """µs a link of a graph-replayed chain of `launches` kernels of `programs` programs each,
    after checking that the chain ran in order."""
    values = torch.zeros(launches + 1, _STRIDE, dtype=torch.int32, device="cuda")
    graph = _captured(lambda: chain(values, programs, use_pdl))
    values.zero_()
    graph.replay()
    torch.cuda.synchronize()
    if int(values[-1, 0]) != launches:
        raise RuntimeError(f"the chain ran out of order: {int(values[-1, 0])} != {launches}")
    return _replay_us(graph, launches, replays)


def norm_us(launches: int, replays: int, width: int = 4096) -> float:
    """µs a launch of a graph-replayed chain of residual add + RMSNorm launches over one bf16
    row of `width`, rounding it to int8 for Q4_K's layout, each on the one before's output."""
    from shared.kernels.norm import add_rms_norm_int8

    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(1, width, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    weight = torch.ones(width, dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        h, r = x, res
        for _ in range(launches):
            h, r, _ = add_rms_norm_int8(h, r, weight, 1e-5, ((32, 8),))

    return _replay_us(_captured(run), launches, replays)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=256)
    p.add_argument("--programs", nargs="+", type=int, default=[1, 132, 528, 1056])
    p.add_argument("--replays", type=int, default=50)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch_floor needs a CUDA device")
    device = torch.device("cuda")
    modes = [False, True] if pdl(device, _link_kernel) else [False]
    print(f"{torch.cuda.get_device_name()}: µs a link, {a.launches} links a graph, "
          f"{a.replays} replays")  # fmt: skip
    print("programs | " + " | ".join("PDL" if m else "plain" for m in modes))
    for programs in a.programs:
        cells = [f"{link_us(a.launches, programs, m, a.replays):.2f}" for m in modes]
        print(f"{programs} | " + " | ".join(cells), flush=True)
    # the engine's choice of PDL (SKIFF_PDL) for the kernels it launches
    print(f"add + RMSNorm + int8, 4096 wide: {norm_us(a.launches, a.replays):.2f} µs a launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
