"""The worker's control channel: a DEALER to the gateway's ROUTER, owned by its own thread.

It announces the worker (and re-announces, so a restarted gateway learns of it), sends
heartbeats even while the engine is busy in a long step, and hands requests to the engine
thread through a queue. ZeroMQ sockets are not thread-safe: only this thread touches the DEALER.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from shared.protocol import (
    HEARTBEAT_INTERVAL_S,
    GatewayToWorker,
    Heartbeat,
    WorkerReady,
    WorkerToGateway,
    decoder,
    encoder,
)

REANNOUNCE_S = 2.0


class ControlChannel:
    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        ready: WorkerReady,
        heartbeat: Callable[[], Heartbeat],
    ) -> None:
        self.inbox: queue.Queue[GatewayToWorker] = queue.Queue()
        self.outbox: queue.Queue[WorkerToGateway] = queue.Queue()
        self._ctx = ctx
        self._address = address
        self._ready = ready
        self._heartbeat = heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def send(self, msg: WorkerToGateway) -> None:
        self.outbox.put(msg)

    def _run(self) -> None:
        enc, dec = encoder(), decoder(GatewayToWorker)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._ready.worker_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        next_beat = next_announce = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_announce:
                    sock.send(enc.encode(self._ready))
                    next_announce = now + REANNOUNCE_S
                if now >= next_beat:
                    sock.send(enc.encode(self._heartbeat()))
                    next_beat = now + HEARTBEAT_INTERVAL_S
                while True:
                    try:
                        sock.send(enc.encode(self.outbox.get_nowait()))
                    except queue.Empty:
                        break
                if dict(poller.poll(timeout=5)).get(sock):
                    while True:
                        try:
                            frame = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self.inbox.put(dec.decode(frame))
                        except msgspec.DecodeError:
                            continue  # a malformed frame is dropped, never fatal
        finally:
            sock.close(linger=0)
