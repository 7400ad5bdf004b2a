"""ZMQ side of the gateway: sends requests to workers and routes their tokens back.

Sockets (shared/protocol.py): a bound ROUTER for control (Generate/Abort down; WorkerReady,
Heartbeat, Rejected, Prefilled up) and a bound PULL for `StepTokens`. Each HTTP request owns a
`RequestStream`, an asyncio queue that receives its `TokenOut`s, or one `Failure` when the worker
rejects it, dies or restarts. Liveness is checked by a reaper task every quarter timeout.

With prefill workers (workers.py, "Roles"), a request starts on one as `prefill_only`; its first
token arrives on the token socket and its `Prefilled` on the control socket, in either order:
the request moves to a decode worker once both have (the tokens the client has are the ones
the decode worker continues from), and only its current worker's tokens reach the stream, so
none is repeated or lost. A request whose prefill worker dies before that moves to another
worker (a decode worker prefills it), once; a decode worker's death fails its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from services.gateway.errors import ApiError
from services.gateway.workers import Departed, WorkerRegistry
from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Generate,
    Heartbeat,
    Prefilled,
    Rejected,
    Sampling,
    TokenOut,
    WorkerReady,
    WorkerToGateway,
    WorkerTokens,
    decoder,
    encoder,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    """The request ended without a result; `status` is the HTTP status to report."""

    status: int
    message: str


class RequestStream:
    """One request's events: `TokenOut`s in order, ending with a finish reason or a Failure."""

    def __init__(self, request_id: str, request: Generate) -> None:
        self.request_id = request_id
        self.request = request  # as the client asked (prompt, max_tokens, sampling, stops)
        self.worker_id = ""  # the worker whose tokens it takes now
        self.prefilling = False  # on a prefill worker, to be handed on
        self.output_ids: list[int] = []  # the tokens the stream received
        self.prefilled: Prefilled | None = None  # a hand-off waiting for its tokens
        self.moves = 0  # times it moved to another worker after its prefill worker died
        self.queue: asyncio.Queue[TokenOut | Failure] = asyncio.Queue()
        self.done = False  # set by the router once nothing more will arrive

    async def get(self, timeout: float | None = None) -> TokenOut | Failure | None:
        """The next event, or None when `timeout` passes first."""
        if not self.queue.empty():  # the common case while tokens flow: no timer, no task
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None


class Router:
    def __init__(
        self,
        worker_bind: str,
        tokens_bind: str,
        heartbeat_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_bind = worker_bind
        self.tokens_bind = tokens_bind
        self.registry = WorkerRegistry(heartbeat_timeout_s)
        self._clock = clock
        self._streams: dict[str, RequestStream] = {}
        self._encode = encoder().encode
        self._decode_control = decoder(WorkerToGateway).decode
        self._decode_tokens = decoder(WorkerTokens).decode
        self._ctx: zmq.asyncio.Context | None = None
        self._control: zmq.asyncio.Socket | None = None
        self._tokens: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._unknown_logged: set[str] = set()
        self.moves = {"handed_on": 0, "prefill_lost": 0}  # requests moved between workers

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._control = self._ctx.socket(zmq.ROUTER)
        # A send to a worker that is gone must fail now, not vanish silently.
        self._control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted worker reconnects under its old identity before the old pipe is noticed
        # dead; without handover the ROUTER would ignore the new connection.
        self._control.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._control.bind(self.worker_bind)
        self._tokens = self._ctx.socket(zmq.PULL)
        self._tokens.bind(self.tokens_bind)
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="gateway-control"),
            asyncio.create_task(self._tokens_loop(), name="gateway-tokens"),
            asyncio.create_task(self._reaper_loop(), name="gateway-reaper"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for stream in list(self._streams.values()):
            self._finish(stream, Failure(503, "the gateway is shutting down"))
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- requests -------------------------------------------------------------------------
    async def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop_ids: list[int],
        domain: str = "",
        prefer: str = "",
    ) -> RequestStream:
        """Send a request to a prefill worker (to be handed on) or to the least-loaded worker
        that fits it; to worker `prefer` when it is one of those that fit (a request's n
        choices go together, so its prefix cache can hold their prompt once)."""
        total = len(prompt_ids) + max_tokens
        if self.registry.choose(total) is None:
            if not self.registry.ready_workers():
                raise ApiError(503, "no worker is ready to serve requests; try again shortly")
            raise ApiError(
                503, "no ready worker can hold this request (prompt + max_tokens too long)"
            )
        request_id = uuid.uuid4().hex
        stream = RequestStream(
            request_id,
            Generate(request_id, prompt_ids, max_tokens, sampling, stop_ids, domain=domain),
        )
        self._streams[request_id] = stream
        failure = await self._route(stream, prefer=prefer)
        if failure is not None:
            self._drop(stream)
            raise ApiError(failure.status, failure.message)
        return stream

    async def _route(
        self,
        stream: RequestStream,
        prefilled: Prefilled | None = None,
        exclude: str = "",
        prefer: str = "",
    ) -> Failure | None:
        """Send the stream's request on from where the client's tokens are: to a prefill
        worker while it has none and one is there, else to a decode worker (with the tokens so
        far and, from a `Prefilled`, the generator's state). A Failure when none can take it."""
        req, out = stream.request, stream.output_ids
        total = len(req.prompt_ids) + req.max_tokens
        worker = None
        if not out and req.max_tokens > 1:
            worker = self.registry.choose_prefill(total, prefer)
        stream.prefilling = worker is not None
        if worker is None:
            worker = self.registry.choose(total, exclude, prefer)
        if worker is None:
            return Failure(503, "no ready worker can take this request on; please retry")
        msg = msgspec.structs.replace(
            req,
            prefill_only=stream.prefilling,
            output_ids=list(out),
            rng_state=prefilled.rng_state if prefilled is not None else b"",
            rng_device=prefilled.rng_device if prefilled is not None else "",
        )
        stream.worker_id = worker.worker_id
        prompt_tokens = len(req.prompt_ids) if stream.prefilling else 0
        self.registry.assign(worker.worker_id, stream.request_id, prompt_tokens)
        try:
            await self._control.send_multipart([worker.identity, self._encode(msg)])
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the connection is gone
            self.registry.release(worker.worker_id, stream.request_id)
            return Failure(503, f"worker {worker.worker_id} is unreachable ({exc.strerror})")
        return None

    async def _hand_on(self, stream: RequestStream) -> None:
        """A prefilled request whose tokens have all arrived goes to a decode worker."""
        p = stream.prefilled
        if p is None or len(stream.output_ids) < len(p.output_ids):
            return
        stream.prefilled = None
        if stream.output_ids[: len(p.output_ids)] != p.output_ids:
            self._finish(stream, Failure(500, "the prefill worker's tokens do not match"))
            return
        self.registry.release(stream.worker_id, stream.request_id)
        failure = await self._route(stream, p, exclude=stream.worker_id)
        if failure is not None:
            self._finish(stream, failure)
        else:
            self.moves["handed_on"] += 1

    async def abort(self, stream: RequestStream) -> None:
        """Stop a request the client no longer wants, so its worker frees its KV blocks."""
        if stream.done:
            return
        self._drop(stream)
        worker = self.registry.get(stream.worker_id)
        if worker is None or self._control is None:
            return
        with contextlib.suppress(zmq.ZMQError):  # a vanished worker has nothing to free
            await self._control.send_multipart(
                [worker.identity, self._encode(Abort(stream.request_id))]
            )

    def _drop(self, stream: RequestStream) -> None:
        stream.done = True
        self._streams.pop(stream.request_id, None)
        self.registry.release(stream.worker_id, stream.request_id)

    def _finish(self, stream: RequestStream, event: TokenOut | Failure) -> None:
        self._drop(stream)
        stream.queue.put_nowait(event)

    async def _fail_departed(self, departed: Departed) -> None:
        log.warning("worker %s left (%s)", departed.worker_id, departed.reason)
        for request_id in departed.request_ids:
            stream = self._streams.get(request_id)
            if stream is not None and stream.prefilling and stream.moves == 0:
                # its prompt is lost with the prefill worker: another worker computes it (the
                # tokens the client has are kept), once
                stream.moves += 1
                stream.prefilled = None
                log.warning("request %s moves on from prefill worker %s", request_id,
                            departed.worker_id)  # fmt: skip
                failure = await self._route(stream, exclude=departed.worker_id)
                if failure is None:
                    self.moves["prefill_lost"] += 1
                    continue
            if stream is not None:
                self._finish(
                    stream,
                    Failure(
                        503,
                        f"worker {departed.worker_id} failed while serving this request "
                        f"({departed.reason}); the request was lost, please retry",
                    ),
                )

    # -- receive loops --------------------------------------------------------------------
    async def _control_loop(self) -> None:
        while True:
            frames = await self._control.recv_multipart()
            try:
                msg = self._decode_control(frames[-1])
            except msgspec.DecodeError as exc:
                log.warning("undecodable control message: %s", exc)
                continue
            now = self._clock()
            if isinstance(msg, Prefilled):
                stream = self._streams.get(msg.request_id)
                if stream is not None and stream.prefilling:
                    stream.prefilled = msg
                    await self._hand_on(stream)
            elif isinstance(msg, Heartbeat):
                if not self.registry.on_heartbeat(msg, now) and (
                    msg.worker_id not in self._unknown_logged
                ):
                    self._unknown_logged.add(msg.worker_id)
                    log.warning("heartbeat from %s, which never sent ready", msg.worker_id)
            elif isinstance(msg, WorkerReady):
                await self._on_ready(msg, frames[0], now)
            elif isinstance(msg, Rejected):
                stream = self._streams.get(msg.request_id)
                if stream is not None:
                    self._finish(stream, Failure(msg.status, msg.message))

    async def _on_ready(self, msg: WorkerReady, identity: bytes, now: float) -> None:
        if msg.protocol != PROTOCOL_VERSION:
            log.error(
                "worker %s speaks protocol %d, the gateway %d: ignored",
                msg.worker_id,
                msg.protocol,
                PROTOCOL_VERSION,
            )
            return
        self._unknown_logged.discard(msg.worker_id)
        known = self.registry.get(msg.worker_id)
        refresh = known is not None and known.ready.instance == msg.instance and msg.instance
        departed = self.registry.on_ready(msg, identity, now)
        if departed is not None:
            await self._fail_departed(departed)
        if refresh:
            return  # a periodic re-announcement: nothing new to say
        log.info(
            "worker %s ready: %s (%s), roles %s, max_model_len %d",
            msg.worker_id,
            msg.device,
            msg.device_name,
            ",".join(msg.roles),
            msg.max_model_len,
        )

    async def _tokens_loop(self) -> None:
        while True:
            payload = await self._tokens.recv()
            try:
                step = self._decode_tokens(payload)
            except msgspec.DecodeError as exc:
                log.warning("undecodable token message: %s", exc)
                continue
            self.registry.touch(step.worker_id, self._clock())
            for tok in step.tokens:
                stream = self._streams.get(tok.request_id)
                if stream is None or stream.worker_id != step.worker_id:
                    continue  # aborted or failed already, or from a worker it has left
                stream.output_ids.append(tok.token_id)
                if tok.finish_reason is None:
                    stream.queue.put_nowait(tok)
                    if stream.prefilled is not None:
                        await self._hand_on(stream)
                else:
                    self._finish(stream, tok)

    async def _reaper_loop(self) -> None:
        period = self.registry.heartbeat_timeout_s / 4
        while True:
            await asyncio.sleep(period)
            for departed in self.registry.reap(self._clock()):
                await self._fail_departed(departed)
