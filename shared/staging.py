"""Small host inputs of a step (token ids, positions, sampling parameters) moved to the device.

A pageable host->GPU copy blocks until the stream drains (i.e. the forward pass in flight);
staging through pinned memory and copying asynchronously keeps the CPU running ahead of the GPU.
Each copy still holds the stream for a few microseconds, so a step's integer inputs travel
together (``to_device_packed``): one buffer, one copy, views for each.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "to_device_packed"]

# every view starts 16 bytes into the buffer's multiple (its base is the allocator's, aligned
# wider): kernels are specialized on pointer alignment, so a view's offset must not change it
_ALIGN_BYTES = 16


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _padded(n: int, itemsize: int) -> int:
    per = _ALIGN_BYTES // itemsize
    return -(-n // per) * per


def to_device_packed(
    parts: list[tuple[list[int], torch.dtype]], device: torch.device | str
) -> list[torch.Tensor]:
    """Integer lists (int64 or int32 each) as 1-D device tensors, in one host->device copy:
    views of one buffer, each contiguous and 16-byte aligned."""
    offsets, total = [], 0  # in bytes
    for values, dtype in parts:
        offsets.append(total)
        total += _padded(len(values), dtype.itemsize) * dtype.itemsize
    host = torch.zeros(total, dtype=torch.uint8)
    for (values, dtype), at in zip(parts, offsets, strict=True):
        if values:
            end = at + len(values) * dtype.itemsize
            host[at:end].view(dtype).copy_(torch.tensor(values, dtype=dtype))
    dev = to_device(host, device)
    return [
        dev[at : at + len(values) * dtype.itemsize].view(dtype)
        for (values, dtype), at in zip(parts, offsets, strict=True)
    ]
