"""Gated MLP activations: SiLU(gate)·up (llama, qwen) and GELU-tanh(gate)·up (gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up
