"""How long the KV tiers' restores take, as the worker sees them: from a prompt's lookup sent to
its blocks in the pool (the latency a request waits), and the RAM tier -> pool copies alone (for
the restore bandwidth). On a GPU the copies are queued: their time is read from CUDA events
once those have passed, never waited for. Heartbeats carry both as histograms
(`Heartbeat.kv_restore`) to the gateway's /metrics."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from shared.protocol import Histogram

# seconds: a 32k-token context's restore from RAM should take ~0.1 s on a GPU, a few blocks on
# the CPU a millisecond, a lookup that waited out the kvcache up to a second
BOUNDS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = BOUNDS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def wire(self) -> Histogram:
        return Histogram(list(self.bounds), list(self.counts), self.sum)


@dataclass
class _Pending:
    asked: float  # perf_counter when the lookup was sent
    began: float  # perf_counter when the copies were queued
    start: object  # a CUDA event before the copies, or began (the CPU's copies are done)
    end: object  # a CUDA event after them, or perf_counter after them


class RestoreTimer:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.latency = LatencyHistogram()
        self.copy = LatencyHistogram()
        self.copy_us = 0  # every copy's time, summed (Heartbeat.kv_tiers "restore_us")
        self._pending: list[_Pending] = []

    def _clock(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self) -> tuple[float, object]:
        """Before a restore's copies are queued."""
        return time.perf_counter(), self._clock()

    def end(self, asked: float, began: tuple[float, object]) -> None:
        """After them: the restore of a lookup sent at `asked` (perf_counter)."""
        self._pending.append(_Pending(asked, began[0], began[1], self._clock()))
        self.poll()

    def poll(self) -> None:
        """Observes the restores whose copies have finished (in order)."""
        while self._pending:
            p = self._pending[0]
            if not self.cuda:
                copy_s = p.end - p.start
            elif p.end.query():
                copy_s = p.start.elapsed_time(p.end) / 1e3
            else:
                return
            self._pending.pop(0)
            self.copy_us += int(copy_s * 1e6)
            self.copy.observe(copy_s)
            # the copies began on the device no sooner than they were queued (on a GPU they
            # may wait behind a step: then this is short by that wait)
            self.latency.observe(p.began - p.asked + copy_s)

    def histograms(self) -> dict[str, Histogram]:
        return {"latency": self.latency.wire(), "copy": self.copy.wire()}
