"""Which devices `skiff serve` gives workers: the cores a process may use, the CUDA devices torch
sees (asked of a subprocess: the launcher holds no CUDA context), and a `--devices` list checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

_DEVICE = re.compile(r"cpu|cuda:\d+")
_REMOTE = re.compile(r"tcp://[\w.\-]+:\d+")  # a pipeline's stage server on another host


def cpu_count() -> int:
    """The cores this process may run on (its affinity: a container's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def count_cuda_devices(timeout_s: float = 120.0) -> int:
    """CUDA devices torch sees, asked of a subprocess (0 when torch or CUDA is unusable)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return 0


def resolve_devices(
    spec: str, cuda_count: Callable[[], int] = count_cuda_devices, repeats: bool = False
) -> list[str]:
    """One device name per worker. `cuda_count` is only called when the spec needs it."""
    spec = spec.strip().lower()
    if spec in ("auto", "cuda"):
        n = cuda_count()
        if n == 0 and spec == "cuda":
            raise ValueError("--devices cuda: torch sees no CUDA device")
        return [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError("--devices is empty")
    for i, d in enumerate(devices):
        if _REMOTE.fullmatch(d) and repeats and i > 0:
            continue  # a later pipeline stage (repeats: a pipeline's devices)
        if not _DEVICE.fullmatch(d):
            raise ValueError(
                f"--devices: {d!r} is not cpu or cuda:N (or, after the first device of a "
                "--pipeline, tcp://HOST:PORT of a stage server)"
            )
    if len(set(devices)) != len(devices) and not repeats:
        # Two workers on one device would each size their KV pool from the same free memory.
        raise ValueError(f"--devices names a device twice: {spec}")
    return devices
