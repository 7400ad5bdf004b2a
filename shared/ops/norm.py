"""RMSNorm, computed in float32 like llama.cpp whatever the activation dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x * rsqrt(mean(x^2) + eps) * weight in float32, as one op
    return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)
