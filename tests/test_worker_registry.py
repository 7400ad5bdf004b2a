"""The gateway's worker registry: re-announcements refresh, restarts fail the old requests,
silence past the timeout reaps."""

from __future__ import annotations

from services.gateway.workers import WorkerRegistry
from shared.protocol import Heartbeat, WorkerReady


def ready(instance: str, pid: int = 10) -> WorkerReady:
    return WorkerReady(
        "w1", "cpu", "CPU", ["prefill", "decode"], "m", 64, 16, 2048, pid, instance=instance
    )


def test_reannouncement_keeps_requests_and_restart_fails_them() -> None:
    reg = WorkerRegistry(heartbeat_timeout_s=0.8)
    assert reg.on_ready(ready("a"), b"w1", now=0.0) is None
    reg.assign("w1", "r1")
    assert reg.on_ready(ready("a"), b"w1", now=1.0) is None  # periodic re-announce
    assert reg.get("w1").requests == {"r1"}
    gone = reg.on_ready(ready("b", pid=11), b"w1", now=2.0)  # a new process under the same id
    assert gone is not None and gone.request_ids == ["r1"]
    assert reg.get("w1").requests == set()


def test_silent_worker_is_reaped_and_heartbeats_keep_it() -> None:
    reg = WorkerRegistry(heartbeat_timeout_s=0.8)
    reg.on_ready(ready("a"), b"w1", now=0.0)
    assert reg.on_heartbeat(Heartbeat("w1", 1, 63, 1, 0), now=0.7)
    assert reg.reap(now=1.2) == []
    assert [d.worker_id for d in reg.reap(now=1.6)] == ["w1"]
    assert reg.ready_workers() == []
