"""A request's deltas with its tool calls parsed out: each choice's text goes through a parser
of its own (tool_calls.py), so a delta carries the content shown so far and the calls completed
so far; text that may still be a call is held back, with its logprobs, until it is decided.
A choice that called a tool and stopped ends with finish_reason "tool_calls"."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from services.gateway.choices import Choices
from services.gateway.generation import Delta, TokenLogprob
from services.gateway.tool_calls import CallParser, ToolCall


class ChoiceCalls:
    """One choice's deltas in, the same deltas with calls parsed out (None: all held back)."""

    def __init__(self, parser: CallParser) -> None:
        self.parser = parser
        self.called = False
        self._entries: list[TokenLogprob] = []

    def push(self, delta: Delta) -> Delta | None:
        parts = self.parser.push(delta.text)
        if delta.finish_reason is not None:
            parts += self.parser.flush()
        text = "".join(p for p in parts if isinstance(p, str))
        calls = [p for p in parts if isinstance(p, ToolCall)]
        self.called = self.called or bool(calls)
        self._entries += delta.logprobs
        finish = delta.finish_reason
        if finish == "stop" and self.called:
            finish = "tool_calls"
        if not text and not calls and finish is None:
            return None
        out = Delta(text, self._entries, finish, calls)
        self._entries = []
        return out


async def with_tool_calls(
    choices: Choices, make_parser: Callable[[], CallParser]
) -> AsyncIterator[tuple[int, Delta]]:
    parsers = [ChoiceCalls(make_parser()) for _ in choices.gens]
    async for index, delta in choices:
        out = parsers[index].push(delta)
        if out is not None:
            yield index, out
