"""One choice's generation as seen by an HTTP handler: tokens from the worker in, text deltas out.

`Generation` submits the request, turns each `TokenOut` into text (incremental detokenizer, stop
ids hidden, stop strings cut with hold-back), attaches logprobs, counts tokens and observes
latencies (the prompt's tokens are counted once per HTTP request, by choices.py). It aborts the
request on the worker when a stop string ends it, when the client goes away, and when the
handler stops early for any other reason (`close()` in a finally).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Failure, RequestStream, Router
from services.gateway.streaming import StopMatcher
from services.gateway.tool_calls import ToolCall
from shared.protocol import Sampling, TokenOut
from shared.tokenizer import IncrementalDetokenizer, Tokenizer

# How often a handler waiting for tokens checks that its client is still connected.
DISCONNECT_POLL_S = 0.1


class ClientGone(Exception):
    """The HTTP client closed the connection."""


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_bytes: bytes
    logprob: float
    top: list[tuple[str, bytes, float]]  # the k most likely tokens, best first
    text_offset: int  # characters of output text before this token


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed by tool_deltas.py


class Generation:
    def __init__(
        self,
        request: web.Request,
        router: Router,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        stops: tuple[str, ...],
        want_logprobs: bool,
        arrived: float,
    ) -> None:
        self.request = request
        self.router = router
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.stream: RequestStream | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the worker's KV cache supplied
        self._detok = IncrementalDetokenizer(tokenizer, skip_special=True)
        self._stops = StopMatcher(stops)
        self._want_logprobs = want_logprobs
        self._arrived = arrived
        self._last_token_at: float | None = None
        self._text_chars = 0
        self._pending: list[TokenLogprob] = []
        self._finished = False
        self._stop_ids: frozenset[int] = frozenset()

    async def start(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop_ids: list[int],
        domain: str = "",
        prefer: str = "",
    ) -> None:
        self.stream = await self.router.submit(
            prompt_ids, max_tokens, sampling, stop_ids, domain, prefer
        )
        self.prompt_tokens = len(prompt_ids)
        self._stop_ids = frozenset(stop_ids)

    async def close(self) -> None:
        """Abort on the worker unless the request already ended there."""
        if self.stream is not None:
            await self.router.abort(self.stream)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Delta:
        while not self._finished:
            event = await self.stream.get(DISCONNECT_POLL_S)
            # Checked on every event too: a busy stream may never time out.
            if client_gone(self.request):
                raise ClientGone()
            if event is None:
                continue
            if isinstance(event, Failure):
                raise ApiError(event.status, event.message)
            delta = self._on_token(event)
            if delta is not None:
                if delta.finish_reason is not None:
                    self._finished = True
                    if delta.finish_reason == "stop" and not self.stream.done:
                        await self.router.abort(self.stream)  # a stop string ended it here
                return delta
        raise StopAsyncIteration

    def _on_token(self, tok: TokenOut) -> Delta | None:
        finish = tok.finish_reason
        if finish in ("abort", "error"):
            raise ApiError(
                503 if finish == "abort" else 500,
                f"the worker ended the request ({finish}) before it was complete",
            )
        self._observe_timing()
        self.cached_tokens = self.cached_tokens or tok.cached_tokens
        self.completion_tokens += 1
        self.metrics.generation_tokens.inc()
        # A stop id that ends the output: counted, never shown. (A token that completes a
        # grammar also ends it with "stop", and is shown.)
        hidden = finish == "stop" and tok.token_id in self._stop_ids
        text = "" if hidden else self._detok.push(tok.token_id)
        if finish is not None:
            text += self._detok.flush()
        if self._want_logprobs:  # the stop token too: one entry per counted token, as vLLM
            self._pending.append(self._logprob(tok))
        self._text_chars += len(text)
        shown, matched = self._stops.push(text)
        if matched:
            return self._delta(shown, "stop")
        if finish is not None:
            return self._delta(shown + self._stops.flush(), finish)
        if shown:
            return self._delta(shown, None)
        return None  # held back (partial character or partial stop string)

    def _delta(self, text: str, finish: str | None) -> Delta:
        delta = Delta(text, self._pending, finish)
        self._pending = []
        return delta

    def _observe_timing(self) -> None:
        now = time.perf_counter()
        if self._last_token_at is None:
            self.metrics.ttft.observe(now - self._arrived)
        else:
            self.metrics.itl.observe(now - self._last_token_at)
        self._last_token_at = now

    def _logprob(self, tok: TokenOut) -> TokenLogprob:
        piece = self.tokenizer.token_to_piece(tok.token_id)
        top = [
            (self._piece_text(i), self.tokenizer.token_to_piece(i), lp)
            for i, lp in zip(tok.top_ids or [], tok.top_logprobs or [], strict=False)
        ]
        return TokenLogprob(
            piece.decode("utf-8", "replace"), piece, tok.logprob, top, self._text_chars
        )

    def _piece_text(self, token_id: int) -> str:
        return self.tokenizer.token_to_piece(token_id).decode("utf-8", "replace")
