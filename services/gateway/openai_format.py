"""Response bodies of the OpenAI API: text completions and chat completions, whole (every
choice) or as stream chunks (one choice's delta each, with its index), with logprobs in each
endpoint's own shape (legacy dicts for completions, lists of objects for chat), and a chat
choice's tool calls (`message.tool_calls`, or `delta.tool_calls` entries with their index)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.generation import TokenLogprob
from services.gateway.tool_calls import ToolCall


@dataclass
class ChoiceOutput:
    """One choice of a whole (non-streamed) response, as it accumulates."""

    text: str
    entries: list[TokenLogprob] = field(default_factory=list)
    finish: str = "length"  # until a delta says otherwise
    tool_calls: list[ToolCall] = field(default_factory=list)


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached`: prompt tokens served from the KV cache (any tier),
    shown as prompt_tokens_details.cached_tokens when there are any."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def completion_logprobs(entries: list[TokenLogprob]) -> dict[str, list]:
    """Legacy format; the chosen token is always among its top dict, as in vLLM."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{**{t: lp for t, _, lp in e.top}, e.token: e.logprob} for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, list]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token_bytes),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top
                ],
            }
            for e in entries
        ]
    }


class _Format:
    prefix = ""  # of response ids
    chunk_object = ""  # the `object` of stream chunks

    def __init__(self, model: str, want_logprobs: bool, include_usage: bool) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage  # streams: "usage": null on chunks, then a usage chunk

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached: int = 0
    ) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [])
        chunk["usage"] = usage(prompt_tokens, completion_tokens, cached)
        return chunk


class CompletionFormat(_Format):
    prefix = "cmpl"
    chunk_object = "text_completion"

    def _choice(
        self, index: int, text: str, entries: list[TokenLogprob], finish: str | None
    ) -> dict[str, Any]:
        logprobs = completion_logprobs(entries) if self.want_logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return None

    def chunk(
        self,
        index: int,
        text: str,
        entries: list[TokenLogprob],
        finish: str | None,
        tool_calls: list[ToolCall] | None = None,  # never any: tools are a chat field
    ) -> dict[str, Any]:
        return self._envelope("text_completion", [self._choice(index, text, entries, finish)])

    def response(
        self, outputs: list[ChoiceOutput], prompt: int, completion: int, cached: int = 0
    ) -> dict[str, Any]:
        choices = [self._choice(i, o.text, o.entries, o.finish) for i, o in enumerate(outputs)]
        body = self._envelope("text_completion", choices)
        body["usage"] = usage(prompt, completion, cached)
        return body


class ChatFormat(_Format):
    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, list] | None:
        return chat_logprobs(entries) if self.want_logprobs else None

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        """Each choice's stream opens with the role, as OpenAI's do."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(self.chunk_object, [choice])

    def chunk(
        self,
        index: int,
        text: str,
        entries: list[TokenLogprob],
        finish: str | None,
        tool_calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        if tool_calls:
            delta["tool_calls"] = [{"index": c.index, **c.as_openai()} for c in tool_calls]
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(entries) if entries else None,
            "finish_reason": finish,
        }
        return self._envelope(self.chunk_object, [choice])

    def response(
        self, outputs: list[ChoiceOutput], prompt: int, completion: int, cached: int = 0
    ) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": _message(o),
                "logprobs": self._logprobs(o.entries),
                "finish_reason": o.finish,
            }
            for i, o in enumerate(outputs)
        ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt, completion, cached),
        }


def _message(out: ChoiceOutput) -> dict[str, Any]:
    if not out.tool_calls:
        return {"role": "assistant", "content": out.text}
    calls = [c.as_openai() for c in out.tool_calls]
    return {"role": "assistant", "content": out.text or None, "tool_calls": calls}
