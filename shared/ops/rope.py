"""Rotary position embedding in both GGML layouts.

"norm" rotates adjacent pairs (x[2i], x[2i+1]) — the llama converter permutes Q/K weights into it;
"neox" rotates halves (x[i], x[i + d/2]). Only the first `rope_dim` features rotate.
Angles are computed in float32 from integer positions, so no cache goes stale.
"""

from __future__ import annotations

import torch


def rope_angles(
    positions: torch.Tensor,
    rope_dim: int,
    base: float,
    scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [T, rope_dim // 2], for integer positions [T]."""
    exponents = torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (base ** (exponents / rope_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    theta = (positions.float() / scale)[:, None] * inv_freq[None, :]
    return theta.cos(), theta.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, rope_dim // 2]. Returns a new tensor."""
    rope_dim = cos.shape[-1] * 2
    xf = x.float()
    rot, rest = xf[..., :rope_dim], xf[..., rope_dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        a, b = rot[..., : rope_dim // 2], rot[..., rope_dim // 2 :]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    else:  # adjacent pairs are complex numbers: (a + ib)(c + is) is the rotation, in one op
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], rope_dim // 2, 2))
        out = torch.view_as_real(pairs * torch.complex(c, s)).flatten(-2)
    return torch.cat((out, rest), dim=-1).to(x.dtype)
