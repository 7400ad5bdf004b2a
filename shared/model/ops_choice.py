"""Which ops a model built for a device calls (shared.model.ops_backend, native_ops)."""

from __future__ import annotations

import torch

from shared.cpu.native import load
from shared.model.native_ops import NativeOps
from shared.model.ops_backend import TorchOps, TritonOps

__all__ = ["ops_for"]


def ops_for(device: torch.device | str, kind: str = "auto") -> TorchOps:
    """'auto': Triton kernels on CUDA; on the CPU the compiled library's ops where it builds
    (NativeOps), else the torch references."""
    if kind == "auto":
        if torch.device(device).type == "cuda":
            kind = "triton"
        else:
            kind = "native" if load() is not None else "torch"
    if kind == "triton":
        return TritonOps()
    if kind == "native":
        return NativeOps()
    if kind == "torch":
        return TorchOps()
    raise ValueError(f"unknown ops backend '{kind}' (auto, torch, native or triton)")
