"""Chooses the KV cache dtype for a device: FP8 (e4m3) only where the architecture has it."""

from __future__ import annotations

import sys

import torch

from shared.cpu.native import load

FP8_MIN_CAPABILITY = (8, 9)  # Ada and later: e4m3 conversions in hardware (no fp8e4nv before)
NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
         "fp8": torch.float8_e4m3fn}  # fmt: skip


def resolve_kv_dtype(name: str, activation_dtype: torch.dtype, device: str) -> torch.dtype:
    """'auto' = the activation dtype, but float16 on the CPU where its compiled attention
    runs (shared.model.native_ops reads float16 keys at half float32's bytes, as llama.cpp's
    default cache). 'fp8' on a GPU older than sm_89 says why and falls back to
    float16; on the CPU the torch reference reads and writes FP8 (slowly, but correctly)."""
    if name == "auto":
        if torch.device(device).type == "cpu" and load() is not None:
            return torch.float16
        return activation_dtype
    if name not in NAMES:
        raise ValueError(f"unknown KV cache dtype '{name}' (auto, {', '.join(NAMES)})")
    dtype = NAMES[name]
    dev = torch.device(device)
    if dtype is torch.float8_e4m3fn and dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if cap < FP8_MIN_CAPABILITY:
            print(
                f"FP8 KV cache needs compute capability {FP8_MIN_CAPABILITY[0]}."
                f"{FP8_MIN_CAPABILITY[1]} or newer; {torch.cuda.get_device_name(dev)} has "
                f"{cap[0]}.{cap[1]}: using float16 KV instead",
                file=sys.stderr,
            )
            return torch.float16
    return dtype
