"""Facts about where a kernel runs that the launch wrappers need: the interpreter or a GPU, how
many SMs there are to fill, and how much shared memory a program may take."""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


def interpreted(kernel: object) -> bool:
    """Whether @triton.jit built `kernel` for the interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(kernel, InterpretedFunction)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def max_shared_memory(device: torch.device | None) -> int:
    """Bytes of shared memory one program may take on device (opt-in maximum, as Triton checks
    it); no limit off CUDA (the interpreter, the CPU) or without a device."""
    if device is None or device.type != "cuda":
        return 1 << 30
    return _max_shared_memory(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@functools.cache
def _max_shared_memory(index: int) -> int:
    """A device fact, asked of the driver once (every eager decode launch wants it)."""
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
