"""Residual add followed by RMSNorm: the torch reference for shared/kernels/norm.add_rms_norm."""

from __future__ import annotations

import torch

from shared.ops.norm import rms_norm


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x's dtype first."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual
