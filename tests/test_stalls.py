"""The worker's stall log names slow steps, admissions and garbage collections, and nothing
faster than its thresholds."""

from __future__ import annotations

import gc

from shared.worker import stalls
from shared.worker.stalls import StallLog


def test_logs_only_what_crosses_a_threshold() -> None:
    lines: list[str] = []
    log = StallLog(lines.append)
    try:
        log.step(stalls.SLOW_STEP_S / 2, lambda: "never asked")
        log.step(0.125, lambda: "256 tokens of 8 sequences, mixed graph of 256")
        log.admit(stalls.SLOW_ADMIT_S / 2, 1)
        log.admit(0.02, 3)
    finally:
        log.close()
    assert lines == [
        "slow step: 125.0 ms (256 tokens of 8 sequences, mixed graph of 256)",
        "slow admission: 20.0 ms for 3 message(s)",
    ]


def test_times_garbage_collections(monkeypatch) -> None:
    lines: list[str] = []
    monkeypatch.setattr(stalls, "SLOW_GC_S", -1.0)  # every collection counts as slow
    log = StallLog(lines.append)
    try:
        gc.collect()
    finally:
        log.close()
    assert any(line.startswith("slow garbage collection: ") for line in lines)
    assert log._on_gc not in gc.callbacks
    gc.collect()  # no callback left behind
