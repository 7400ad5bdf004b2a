"""Server-sent events and stop-string matching over streamed text.

Stop strings are matched on the detokenized text, not on tokens: a stop string can span tokens
("\\n\\nUser" may arrive as "\\n", "\\nUs", "er"). Text that could be the start of a stop string
is held back until the next token decides, so a client never sees a stop string or part of one.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web


class StopMatcher:
    """Feed generated text in order; `push` returns what is safe to show and whether a stop
    string has been reached (the returned text then ends right before it)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._held + text
        # Emitted text held no stop string nor the start of one, so a match starts in `buf`.
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of `buf` that a stop string starts with."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """End of generation without a stop string: the held-back text is ordinary text."""
        held, self._held = self._held, ""
        return held


class SseWriter:
    """An aiohttp response that sends `data: <json>` events. Writes raise ConnectionResetError
    once the client has gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # nginx would otherwise buffer the whole stream
            },
        )
        self.started = False

    async def start(self) -> None:
        if not self.started:
            self.started = True
            await self.response.prepare(self.request)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.start()
        await self.response.write(b"data: " + msgspec.json.encode(payload) + b"\n\n")

    async def done(self) -> None:
        await self.start()
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def end(self) -> None:
        await self.response.write_eof()
