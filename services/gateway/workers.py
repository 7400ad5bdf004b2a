"""Registry of workers: who is ready, how loaded, who is alive, and which requests each holds.

Pure bookkeeping with an explicit clock (`now` arguments), so it runs without sockets in tests.
The router feeds it every message a worker sends and asks it where to send a request; a worker
that stays silent for the heartbeat timeout is dead and gives back the ids of the requests it
held, so they can fail with a clear error instead of hanging.

Roles: a worker announcing "decode" serves a request alone (it prefills what it is given) and
takes prompts that prefill workers hand on; one announcing only "prefill" computes prompts and
hands them on while a decode worker is there (else it serves alone too). Prompts go to the
prefill worker with the fewest prompt tokens queued, decodes to the decode worker with the
fewest requests, then the most free KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import Heartbeat, WorkerReady


@dataclass
class Worker:
    ready: WorkerReady
    identity: bytes  # the worker's DEALER identity: the ROUTER's address for it
    last_seen: float
    heartbeat: Heartbeat | None = None
    requests: set[str] = field(default_factory=set)  # in flight, as the gateway knows them
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # queued prompts (prefill role)

    @property
    def worker_id(self) -> str:
        return self.ready.worker_id

    @property
    def decodes(self) -> bool:
        return "decode" in self.ready.roles

    @property
    def prefill_only(self) -> bool:
        return not self.decodes and "prefill" in self.ready.roles

    @property
    def kv_fraction_used(self) -> float:
        hb = self.heartbeat
        if hb is None or hb.kv_blocks_used + hb.kv_blocks_free == 0:
            return 0.0
        return hb.kv_blocks_used / (hb.kv_blocks_used + hb.kv_blocks_free)

    @property
    def load(self) -> tuple[int, float]:
        # The gateway's own count of in-flight requests is exact and current; heartbeats lag by
        # up to an interval, so KV occupancy only breaks ties.
        return (len(self.requests), self.kv_fraction_used)


@dataclass
class Departed:
    """A worker that left (silent or restarted) and the requests it took with it."""

    worker_id: str
    request_ids: list[str]
    reason: str


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._workers: dict[str, Worker] = {}

    # -- messages from workers ------------------------------------------------------------
    def on_ready(self, msg: WorkerReady, identity: bytes, now: float) -> Departed | None:
        """A worker announced itself. Workers re-announce periodically (so a restarted gateway
        learns of them): the same instance is only refreshed. A new instance under a known id
        means it restarted: the requests the old incarnation held are gone with it."""
        old = self._workers.get(msg.worker_id)
        if old is not None and msg.instance and old.ready.instance == msg.instance:
            old.ready, old.identity, old.last_seen = msg, identity, now
            return None
        self._workers[msg.worker_id] = Worker(ready=msg, identity=identity, last_seen=now)
        if old is not None and old.requests:
            return Departed(msg.worker_id, sorted(old.requests), "restarted")
        return None

    def on_heartbeat(self, msg: Heartbeat, now: float) -> bool:
        """Record load and liveness; False for a worker that never sent ready (unknown)."""
        worker = self._workers.get(msg.worker_id)
        if worker is None:
            return False
        worker.heartbeat = msg
        worker.last_seen = now
        return True

    def touch(self, worker_id: str, now: float) -> None:
        """Any message from a worker (e.g. tokens) proves it alive."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now

    def reap(self, now: float) -> list[Departed]:
        """Remove workers silent for longer than the timeout."""
        dead = [w for w in self._workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for w in dead:
            del self._workers[w.worker_id]
        return [
            Departed(
                w.worker_id,
                sorted(w.requests),
                f"no heartbeat for {now - w.last_seen:.1f} s",
            )
            for w in dead
        ]

    # -- requests -------------------------------------------------------------------------
    def choose(self, total_tokens: int, exclude: str = "", prefer: str = "") -> Worker | None:
        """The least-loaded decode worker that fits prompt + max_tokens (it prefills what it is
        given); with none, the least-loaded prefill worker, which then serves alone. Worker
        `prefer` wins where it is among those candidates."""
        fits = [
            w
            for w in self._workers.values()
            if w.ready.max_model_len >= total_tokens and w.worker_id != exclude
        ]
        decoders = [w for w in fits if w.decodes]
        return _preferred(decoders or fits, prefer) or min(
            decoders or fits, key=lambda w: w.load, default=None
        )

    def choose_prefill(self, total_tokens: int, prefer: str = "") -> Worker | None:
        """The prefill worker with the fewest prompt tokens queued (or `prefer`, where it is
        one), when a decode worker is there to take its prompts on (None: serve without the
        split)."""
        fits = [w for w in self._workers.values() if w.ready.max_model_len >= total_tokens]
        if not any(w.decodes for w in fits):
            return None
        prefill = [w for w in fits if w.prefill_only]
        return _preferred(prefill, prefer) or min(
            prefill, key=lambda w: (sum(w.prompt_tokens.values()), len(w.requests)), default=None
        )

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def assign(self, worker_id: str, request_id: str, prompt_tokens: int = 0) -> None:
        worker = self._workers[worker_id]
        worker.requests.add(request_id)
        if prompt_tokens:
            worker.prompt_tokens[request_id] = prompt_tokens

    def release(self, worker_id: str, request_id: str) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.requests.discard(request_id)
            worker.prompt_tokens.pop(request_id, None)

    # -- views ----------------------------------------------------------------------------
    def ready_workers(self) -> list[Worker]:
        return list(self._workers.values())

    def all_workers(self) -> list[Worker]:
        return list(self._workers.values())

    def max_model_len(self) -> int | None:
        """The longest sequence any ready worker takes; None while none is ready."""
        return max((w.ready.max_model_len for w in self.ready_workers()), default=None)


def _preferred(candidates: list[Worker], worker_id: str) -> Worker | None:
    return next((w for w in candidates if worker_id and w.worker_id == worker_id), None)
