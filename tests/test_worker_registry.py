"""The gateway's worker registry: re-announcements refresh, restarts fail the old requests,
silence past the timeout reaps, prompts go to prefill workers and decodes to decode workers."""

from __future__ import annotations

from services.gateway.workers import WorkerRegistry
from shared.protocol import Heartbeat, WorkerReady


def ready(
    instance: str, pid: int = 10, worker_id: str = "w1", roles: list[str] | None = None
) -> WorkerReady:
    roles = roles or ["prefill", "decode"]
    return WorkerReady(worker_id, "cpu", "CPU", roles, "m", 64, 16, 2048, pid, instance=instance)


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


def test_prompts_go_to_prefill_workers_while_a_decode_worker_is_there() -> None:
    reg = WorkerRegistry(heartbeat_timeout_s=0.8)
    reg.on_ready(ready("p", worker_id="p1", roles=["prefill"]), b"p1", now=0.0)
    assert reg.choose_prefill(100) is None  # no decode worker: it serves alone
    assert reg.choose(100).worker_id == "p1"
    reg.on_ready(ready("p", worker_id="p2", roles=["prefill"]), b"p2", now=0.0)
    reg.on_ready(ready("d", worker_id="d1", roles=["prefill", "decode"]), b"d1", now=0.0)
    reg.on_ready(ready("d", worker_id="d2", roles=["decode"]), b"d2", now=0.0)
    # the prefill worker with the fewest prompt tokens queued
    reg.assign("p1", "r1", prompt_tokens=900)
    reg.assign("p2", "r2", prompt_tokens=100)
    reg.assign("p2", "r3", prompt_tokens=100)
    assert reg.choose_prefill(100).worker_id == "p2"
    reg.release("p2", "r2")
    reg.release("p2", "r3")
    assert sum(reg.get("p2").prompt_tokens.values()) == 0
    # decodes to the decode worker with the fewest requests, then the most free KV blocks
    reg.assign("d1", "r4")
    assert reg.choose(100).worker_id == "d2"
    assert reg.choose(100, exclude="d2").worker_id == "d1"
    reg.assign("d2", "r5")
    reg.on_heartbeat(Heartbeat("d1", 60, 4, 1, 0), now=0.1)
    reg.on_heartbeat(Heartbeat("d2", 4, 60, 1, 0), now=0.1)
    assert reg.choose(100).worker_id == "d2"
    # a request longer than a worker's context never goes there
    assert reg.choose_prefill(4096) is None and reg.choose(4096) is None
