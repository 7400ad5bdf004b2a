"""Small host inputs of a step (token ids, positions, sampling parameters) moved to the device.

A pageable host->GPU copy blocks until the stream drains (i.e. the forward pass in flight);
staging through pinned memory and copying asynchronously keeps the CPU running ahead of the GPU.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
