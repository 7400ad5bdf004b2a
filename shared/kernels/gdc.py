"""Programmatic dependent launch (Hopper and later): a kernel may start while the one before it
in the stream is still running.

A decode step is about 400 small launches (BENCHMARKS.md 2026-11-30 (u)), and each one waits for
the whole of the previous one: the SMs idle through every kernel's tail and the next one's
launch. Launched with ``launch_pdl`` (``launch_kw``), a kernel's programs may be scheduled once
every program of the previous kernel has called ``launch_next``. Whatever they read that an
earlier kernel wrote, and whatever they write, must come after ``wait_prev``, which returns when
the previous kernel has finished and its stores are visible. Loads of constants (a GEMV's weight
planes) may come before it: that is the gain, the weights stream while the previous kernel ends
(W1 on the H200: +4.5 % for Q4_K_M, +16.2 % for Q8_0, BENCHMARKS.md 2026-11-30 (v)).

Every kernel launched this way calls ``wait_prev`` in every program before it ends, so that
finishing implies the kernel before it finished too: the order of the whole chain holds. The
kernels call ``launch_next`` first thing: a program that launched early only waits, and a
later kernel gets SMs only once every program of the earlier one has started, so the earlier
one can always finish.

Under the interpreter and below sm_90, PDL is False and both are compiled out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.kernels.device import interpreted

__all__ = ["launch_kw", "launch_next", "pdl", "wait_prev"]


def pdl(device: torch.device, kernel: object) -> bool:
    """Whether `kernel`'s launches on `device` use programmatic dependent launch: a GPU of
    compute capability 9.0 or later, not the interpreter."""
    return (
        device.type == "cuda"
        and not interpreted(kernel)
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def launch_kw(use: bool) -> dict:
    """The launch option that goes with the kernel's PDL argument."""
    return {"launch_pdl": True} if use else {}


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel's programs be scheduled (they wait in ``wait_prev``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prev(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its stores are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
