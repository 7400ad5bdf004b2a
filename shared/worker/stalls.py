"""Logs what stalls the worker loop: engine steps, request admissions and garbage collections
that take longer than a threshold, each with what it was doing. A stream's longest gap between
tokens (W3) is one such stall; the log names its cause instead of leaving it to guesswork."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

SLOW_STEP_S = 0.04  # twice a W3 step: a gap a stream notices
SLOW_ADMIT_S = 0.01
SLOW_GC_S = 0.01


class StallLog:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def step(self, seconds: float, what: Callable[[], str]) -> None:
        if seconds > SLOW_STEP_S:
            self.log(f"slow step: {seconds * 1e3:.1f} ms ({what()})")

    def admit(self, seconds: float, n_requests: int) -> None:
        if seconds > SLOW_ADMIT_S:
            self.log(f"slow admission: {seconds * 1e3:.1f} ms for {n_requests} message(s)")

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        seconds = time.perf_counter() - self._gc_start
        if seconds > SLOW_GC_S:
            self.log(
                f"slow garbage collection: {seconds * 1e3:.1f} ms, generation "
                f"{info.get('generation')}, {info.get('collected')} collected"
            )
