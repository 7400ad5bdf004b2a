"""Facts about where a kernel runs that the launch wrappers need: the interpreter or a GPU, how
many SMs there are to fill, how much shared memory a program may take, and how many programs of
a compiled kernel an SM holds at once."""

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


def programs_per_sm(
    n_regs: int, num_warps: int, shared: int, regs_sm: int, threads_sm: int, shared_sm: int
) -> int:
    """Programs of a kernel (n_regs registers a thread, num_warps warps, `shared` bytes of shared
    memory) that one SM holds at once (CUDA's occupancy rule): registers are allocated a warp at
    a time in units of 256, each program also takes 1 KB of shared memory for the system; at most
    32 programs, at least 1."""
    per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = regs_sm // (per_warp * num_warps) if n_regs else 32
    by_threads = threads_sm // (32 * num_warps)
    by_shared = shared_sm // (shared + 1024) if shared_sm else 32
    return max(1, min(by_regs, by_threads, by_shared, 32))


def resident_programs(device: torch.device, n_regs: int, num_warps: int, shared: int) -> int:
    """programs_per_sm on device (a CUDA device; its register file, threads and shared memory
    an SM as torch reports them)."""
    props = torch.cuda.get_device_properties(device)
    return programs_per_sm(
        n_regs, num_warps, shared, getattr(props, "regs_per_multiprocessor", 65536),
        props.max_threads_per_multi_processor,
        getattr(props, "shared_memory_per_multiprocessor", 0),
    )  # fmt: skip
