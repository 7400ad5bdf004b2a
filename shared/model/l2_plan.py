"""Which weights a layer's RoPE + KV-write launch requests into L2 (shared.kernels.l2_prefetch).

Between a layer's Q/K/V GEMV and its gate/up GEMV run RoPE, the attention, its combine, the
output projection and the RMSNorm: mostly latency, with HBM idle. The RoPE launch, the first of
them, asks for the output projection's weights and then as much of the gate/up weights (their
first row tiles, each plane alike) as ``SKIFF_L2_PREFETCH_MB`` allows in all, so that those
GEMVs read that part from L2. Tables are made for decode-sized steps only: larger ones multiply
by dense copies or are bound by compute (TritonOps.attention applies that limit).
"""

from __future__ import annotations

import os

import torch

from shared.kernels.l2_prefetch import table

__all__ = ["attach", "budget_bytes", "plan"]

_ENV = "SKIFF_L2_PREFETCH_MB"
_PLANES = ("q", "hi", "sc", "mn", "d", "dmin")


def budget_bytes() -> int:
    """The bytes a layer's RoPE launch may request (``SKIFF_L2_PREFETCH_MB``, default 0: off)."""
    return int(float(os.environ.get(_ENV, "0")) * (1 << 20))


def _tensors(lin) -> list[torch.Tensor]:
    """What a batch-1 matmul by `lin` (a QuantLinear) reads: its packed planes, else its one
    float copy, else nothing it can name."""
    if lin.packed is not None:
        return [t for name in _PLANES if (t := getattr(lin.packed, name)) is not None]
    if lin.dense_copy is not None:
        return [lin.dense_copy]
    return []


def plan(linears: list, budget: int) -> torch.Tensor | None:
    """The table for `linears` in order: each whole while the budget lasts, then the leading
    part of the next that fits (the same fraction of each of its tensors, so whole row tiles);
    None without a budget or anything to ask for."""
    ranges: list[tuple[torch.Tensor, int]] = []
    left = budget
    for lin in linears:
        ts = _tensors(lin)
        total = sum(t.numel() * t.element_size() for t in ts)
        if left <= 0 or not total:
            break
        share = min(1.0, left / total)
        for t in ts:
            ranges.append((t, int(t.numel() * t.element_size() * share)))
        left -= total
    return table(ranges) if ranges else None


def attach(attn, mlp) -> None:
    """Give `attn` (transformer.Attention) its table: its output projection, then `mlp`'s
    gate/up (transformer.GatedMLP), within budget_bytes()."""
    budget = budget_bytes()
    if budget <= 0:
        return
    up = [mlp.gated.fused] if mlp.gated is not None else list(mlp.gate_up.parts)
    weights = [attn.wo, *up]
    if all(ts and ts[0].is_cuda for ts in map(_tensors, weights)):
        attn.l2_prefetch = plan(weights, budget)
