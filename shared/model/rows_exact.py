"""A dense matmul whose rows do not depend on the rows beside them, on the CPU: what a decode
batch or a speculative step computes for a row is what a one-row decode step computes for it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.ops.paged_attention import ROW_WISE_QUERIES


def rows_exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T, on the CPU a row at a time for a few rows (up to ROW_WISE_QUERIES): a dense
    GEMM of a few rows does not give each row what it gives that row alone (oneDNN's and MKL's
    one-row and many-row kernels sum differently), so a decode batch's or a speculative step's
    rows are each computed as a one-row decode computes them: greedy output independent of
    batching and of drafts. Measured, 640 x 2048 fp32, 2 threads: 9 rows 0.82 ms a row at a
    time, 0.48 ms at once, one row 0.09 ms."""
    x2 = x.reshape(-1, w.shape[1])
    if x.device.type != "cpu" or not 1 < x2.shape[0] <= ROW_WISE_QUERIES:
        return F.linear(x2, w)
    return torch.cat([F.linear(r, w) for r in x2.split(1)])
