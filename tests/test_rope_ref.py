"""The torch RoPE (the CPU worker's, and the kernels' reference) against the rotation written
out pair by pair: both GGML layouts, partial rotary dims, scaled positions."""

from __future__ import annotations

import math

import pytest
import torch

from shared.ops.rope import apply_rope, rope_angles


def _rotated(x: torch.Tensor, positions: list[int], dim: int, base: float, scale: float, neox):
    out = x.clone()
    for t, pos in enumerate(positions):
        for i in range(dim // 2):
            theta = pos / scale * base ** (-2 * i / dim)
            j, k = (i, i + dim // 2) if neox else (2 * i, 2 * i + 1)
            a, b = x[t, :, j], x[t, :, k]
            out[t, :, j] = a * math.cos(theta) - b * math.sin(theta)
            out[t, :, k] = a * math.sin(theta) + b * math.cos(theta)
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("dim", [16, 8])  # the whole head, or its first half
def test_matches_the_rotation_pair_by_pair(neox: bool, dim: int) -> None:
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(dim))
    positions = [0, 7, 1000]
    cos, sin = rope_angles(torch.tensor(positions), dim, 10000.0, 2.0)
    got = apply_rope(x, cos, sin, neox)
    # the angles are float32 (position 500's: ~3e-5 off the float64 ones)
    want = _rotated(x, positions, dim, 10000.0, 2.0, neox)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
