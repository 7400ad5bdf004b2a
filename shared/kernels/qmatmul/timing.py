"""Timing a packed matmul the way a decode step runs it: replayed from a CUDA graph (no Python
launch cost) with the weight cold in L2 (every layer's weights pass through once per token).

``cold_graph_ms`` captures the call once per copy of the weight (``weight_copies``: enough to
exceed twice the L2 cache) and returns the replay time per call. ``triton.testing.do_bench``
instead times Python launches (tens of microseconds, more than a small GEMV takes) and
``do_bench_cudagraph`` repeats one weight that then sits in L2; both mislead at decode sizes.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
import triton.testing

from shared.kernels.qmatmul.layout import PackedWeight
from shared.kernels.qmatmul.packed import unpack
from shared.kernels.qmatmul.packed_matmul import packed_matmul

__all__ = ["cold_dense_ms", "cold_graph_ms", "dense_copies", "matmul_ms", "weight_copies"]

_MAX_COPIES = 64


def weight_copies(pw: PackedWeight, l2: int | None = None) -> list[PackedWeight]:
    """pw and clones of it, together more than twice the L2 cache (the device's by default),
    at most 64 of them."""
    if l2 is None:
        props = torch.cuda.get_device_properties(pw.q.device)
        l2 = getattr(props, "L2_cache_size", 64 << 20)
    n = min(_MAX_COPIES, max(2, -(-2 * l2 // max(pw.nbytes, 1))))
    out = [pw]
    for _ in range(n - 1):
        planes = {
            f.name: getattr(pw, f.name).clone()
            for f in dataclasses.fields(pw)
            if f.init and isinstance(getattr(pw, f.name), torch.Tensor)
        }
        out.append(dataclasses.replace(pw, **planes))
    return out


def cold_graph_ms(
    x: torch.Tensor, copies: list[PackedWeight], config: dict[str, int] | None, reps: int = 5
) -> float:
    """Median ms of one ``packed_matmul(x, w, config=config)`` over the copies of a weight,
    replayed from a CUDA graph."""
    return _graph_ms(x, copies, lambda w: packed_matmul(x, w, config=config), reps)


def dense_copies(pw: PackedWeight, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """pw dequantized to dtype ([N, K]) and clones of it, together at least 200 MB (more than
    twice the H200's L2): the dense side of cold_dense_ms."""
    dense = unpack(pw).to(dtype)
    return [dense] + [dense.clone() for _ in range(200_000_000 // dense.nbytes)]


def cold_dense_ms(x: torch.Tensor, dense: list[torch.Tensor], reps: int = 5) -> float:
    """The same for torch's matmul on dense copies of a weight (``[N, K]`` each, together more
    than twice the L2): what the engine runs on its dense copies."""
    return _graph_ms(x, dense, lambda w: x @ w.T, reps)


def _graph_ms(x: torch.Tensor, weights: list, call, reps: int) -> float:
    call(weights[0])  # compile (or pick a cuBLAS kernel) outside the capture
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w)
    graph.replay()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(weights))
    del graph
    return statistics.median(times)


def matmul_ms(
    x: torch.Tensor, pw: PackedWeight, copies: list[PackedWeight], config: dict[str, int] | None
) -> float:
    """ms per call as the engine runs it: decode sizes (M <= 64) replayed from a CUDA graph with
    cold weights (``copies`` from ``weight_copies(pw)``), prefill sizes by ``do_bench`` (it runs
    eagerly, and its kernels dwarf a launch)."""
    if x.shape[0] <= 64:
        return cold_graph_ms(x, copies, config)
    return triton.testing.do_bench(
        lambda: packed_matmul(x, pw, config=config), warmup=5, rep=20, return_mode="median"
    )
