"""Facts about where a kernel runs that the launch wrappers need: the interpreter or a GPU, and
how many SMs there are to fill."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def interpreted(kernel: object) -> bool:
    """Whether @triton.jit built `kernel` for the interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(kernel, InterpretedFunction)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
