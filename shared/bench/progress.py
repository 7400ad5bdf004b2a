"""A one-line progress bar on stderr (off with --no-progress or when stderr is no terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, enabled: bool = True, out: TextIO | None = None) -> None:
        self.out = out or sys.stderr
        self.enabled = enabled and self.out.isatty()
        self.total = total
        self.done = 0
        self.failed = 0
        self.t0 = time.perf_counter()
        self._draw()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.out.write("\n")
            self.out.flush()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        elapsed = time.perf_counter() - self.t0
        self.out.write(f"\r[{bar}] {self.done}/{self.total}{failed} {elapsed:6.1f} s")
        self.out.flush()
