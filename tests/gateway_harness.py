"""Test harness for the gateway: the real app on a background loop, a fake worker speaking
shared/protocol.py over real sockets, and small HTTP helpers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from aiohttp import web

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.served_model import ServedModel
from shared.protocol import (
    HEARTBEAT_INTERVAL_S,
    Abort,
    GatewayToWorker,
    Generate,
    Heartbeat,
    Rejected,
    StepTokens,
    TokenOut,
    WorkerReady,
    decoder,
    encoder,
)

openai = pytest.importorskip("openai")

REPLY = "Hello world, this is a test"
NAME = "smollm2"
MAX_MODEL_LEN = 2048
KV_USED, KV_FREE, WAITING = 5, 95, 1  # what fake workers report in heartbeats
GRAMMAR = {"steps": 7, "rows": 12, "fill_us": 840, "apply_us": 150}  # likewise
REJECTED_MAX_TOKENS = 777  # fake workers reject requests asking for this many tokens
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], Any], timeout: float = 3.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- the gateway in a thread ----------------------------------------------------------------------


class GatewayServer:
    def __init__(
        self,
        model: ServedModel,
        api_keys: tuple[str, ...] = (),
        handler_cancellation: bool = False,
        heartbeat_timeout_s: float = 0.8,
        key_domains: dict[str, str] | None = None,
    ) -> None:
        self.config = GatewayConfig(
            model=model.path,
            served_model_name=NAME,
            port=free_port(),
            worker_bind=f"tcp://127.0.0.1:{free_port()}",
            tokens_bind=f"tcp://127.0.0.1:{free_port()}",
            api_keys=api_keys,
            heartbeat_timeout_s=heartbeat_timeout_s,
            key_domains=key_domains or {},
        )
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        app = create_app(self.config, model)
        self.runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
        self._call(self._start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.config.port).start()

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)


# -- the fake worker ------------------------------------------------------------------------------


class FakeWorker:
    def __init__(
        self,
        server: GatewayServer,
        worker_id: str,
        reply_ids: list[int],
        eos_id: int,
        step_s: float = 0.003,
    ) -> None:
        self.cfg = server.config
        self.worker_id = worker_id
        self.reply_ids = reply_ids
        self.eos_id = eos_id
        self.step_s = step_s
        self.generates: list[Generate] = []
        self.steps_before: dict[str, int] = {}  # request id -> steps pushed before it came
        self.steps = 0
        self.aborts: list[str] = []
        self.silent = threading.Event()  # stop heartbeats and tokens, as a hung process would
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> FakeWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.worker_id.encode())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.cfg.worker_bind)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self.cfg.tokens_bind)
        enc, dec = encoder(), decoder(GatewayToWorker)
        ready = WorkerReady(
            self.worker_id, "cpu", "fake", ["prefill", "decode"], NAME, 100, 16,
            MAX_MODEL_LEN, os.getpid(),
        )  # fmt: skip
        dealer.send(enc.encode(ready))
        active: dict[str, list] = {}  # request id -> [Generate, tokens sent]
        next_heartbeat = 0.0
        while not self._stop.is_set():
            if dealer.poll(int(self.step_s * 1000) or 1):
                while dealer.poll(0):
                    msg = dec.decode(dealer.recv())
                    if isinstance(msg, Generate) and msg.max_tokens == REJECTED_MAX_TOKENS:
                        rej = Rejected(msg.request_id, 413, "prompt too long for my KV pool")
                        dealer.send(enc.encode(rej))
                    elif isinstance(msg, Generate):
                        self.generates.append(msg)
                        self.steps_before[msg.request_id] = self.steps
                        active[msg.request_id] = [msg, 0]
                    elif isinstance(msg, Abort):
                        self.aborts.append(msg.request_id)
                        active.pop(msg.request_id, None)
            if self.silent.is_set():
                continue
            now = time.monotonic()
            if now >= next_heartbeat:
                hb = Heartbeat(
                    self.worker_id, KV_USED, KV_FREE, len(active), WAITING, grammar=GRAMMAR
                )
                dealer.send(enc.encode(hb))
                next_heartbeat = now + HEARTBEAT_INTERVAL_S
            if active:
                tokens = [self._next(state) for state in active.values()]
                for t in tokens:
                    if t.finish_reason is not None:
                        del active[t.request_id]
                push.send(enc.encode(StepTokens(self.worker_id, tokens)))
                self.steps += 1
        ctx.destroy(linger=0)

    def _next(self, state: list) -> TokenOut:
        gen, pos = state
        state[1] += 1
        k = gen.sampling.logprobs
        lp: dict[str, Any] = {}
        if k is not None:
            lp = {
                "logprob": -0.25,
                "top_ids": self.reply_ids[:k],
                "top_logprobs": [-0.25 - j for j in range(k)],
            }
        if pos == len(self.reply_ids) and gen.stop_ids:
            assert self.eos_id in gen.stop_ids
            return TokenOut(gen.request_id, self.eos_id, finish_reason="stop", **lp)
        finish = "length" if pos + 1 >= gen.max_tokens else None
        token = self.reply_ids[pos % len(self.reply_ids)]
        return TokenOut(gen.request_id, token, finish_reason=finish, **lp)

    def generate_for(self, predicate: Callable[[Generate], bool]) -> Generate:
        return wait_until(
            lambda: next((g for g in self.generates if predicate(g)), None), what="a Generate"
        )


# -- HTTP helpers ---------------------------------------------------------------------------------


def http(
    url: str, body: Any = None, raw: bytes | None = None, key: str | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, _maybe_json(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _maybe_json(exc.read())


def _maybe_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()


def sse_events(url: str, body: dict) -> list[Any]:
    """Every `data:` payload of a streamed response, JSON-decoded ("[DONE]" kept as is)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = resp.read().decode().splitlines()
    payloads = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def open_request(server: GatewayServer, path: str, body: dict) -> socket.socket:
    """A request sent on a raw socket that the test can drop mid-response."""
    sock = socket.create_connection(("127.0.0.1", server.config.port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    sock.settimeout(5)
    buf = b""
    while marker not in buf:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed before {marker!r}: {buf!r}"
        buf += chunk
    return buf


def assert_error(status: int, body: Any, want_status: int, param: str | None = None) -> dict:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err
