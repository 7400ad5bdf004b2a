"""Parsing and validation of OpenAI request bodies into typed requests.

Every check raises a 400 `ApiError` whose `param` names the field, with a message that says what
was expected and what came. Which fields a body may carry at all is request_fields.py's table,
checked first; `null` means "default" for every optional field, as the OpenAI SDKs sometimes
send it. Chat messages are chat_messages.py's, tool fields tools.py's, structured-output fields
structured.py's.
Ranges match shared/sampling/params.py, which owns their meaning on the worker side.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.chat_messages import parse_messages
from services.gateway.errors import invalid, shown
from services.gateway.request_fields import check_chat_fields, check_completion_fields
from services.gateway.structured import grammar_of
from services.gateway.tools import ToolRequest, tools_of
from shared.protocol import DOMAIN_PATTERN, Sampling

MAX_LOGPROBS = 20
MAX_N = 16  # choices per request: n generations of one prompt
MAX_STOP_STRINGS = 4
_INT64 = 2**63


@dataclass(frozen=True)
class GenerationParams:
    """What both endpoints share: how much to generate, how to sample, when to stop."""

    max_tokens: int | None  # None: the endpoint's default
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    n: int = 1  # choices: each a generation of its own, seeded seed + index when seeded
    domain: str = ""  # Skiff's extension: the n-gram table speculation may draw on


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    echo: bool
    params: GenerationParams


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    params: GenerationParams
    tools: ToolRequest | None = None  # tools.py: what the model's template makes of them


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


class Fields:
    """Typed access to a JSON object's fields; each getter raises a 400 naming the field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be a boolean, got {shown(value)}", name)
        return value

    def integer(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise invalid(f"'{name}' must be an integer, got {shown(value)}", name)
        if not lo <= value <= hi:
            raise invalid(f"'{name}' must be between {lo} and {hi}, got {value}", name)
        return value

    def number(
        self, name: str, default: float, lo: float, hi: float, lo_open: bool = False
    ) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise invalid(f"'{name}' must be a number, got {shown(value)}", name)
        value = float(value)
        # Written so that NaN fails both comparisons.
        ok = (value > lo if lo_open else value >= lo) and value <= hi and math.isfinite(value)
        if not ok:
            bracket = "(" if lo_open else "["
            shown_hi = "inf)" if math.isinf(hi) else f"{hi:g}]"
            raise invalid(f"'{name}' must be in {bracket}{lo:g}, {shown_hi}, got {value}", name)
        return value


def _sampling(f: Fields, logprobs: int | None) -> Sampling:
    return Sampling(
        temperature=f.number("temperature", 1.0, 0.0, math.inf),
        top_k=f.integer("top_k", 0, -1, 2**31 - 1),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        min_p=f.number("min_p", 0.0, 0.0, 1.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0, math.inf, lo_open=True),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0),
        seed=f.integer("seed", None, -_INT64, _INT64 - 1),
        logprobs=logprobs,
        grammar=grammar_of(f.body),
    )


def _stop(f: Fields) -> tuple[str, ...]:
    value = f.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    if len(value) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(s for s in value if s)  # an empty stop string would end every request at once


def _common(f: Fields, max_tokens: int | None, logprobs: int | None) -> GenerationParams:
    stream = f.boolean("stream", False)
    options = f.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        include_usage = Fields(options).boolean("include_usage", False)
    return GenerationParams(
        max_tokens=max_tokens,
        sampling=_sampling(f, logprobs),
        stop=_stop(f),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=f.boolean("ignore_eos", False),
        n=f.integer("n", 1, 1, MAX_N),
        domain=_domain(f),
    )


def _domain(f: Fields) -> str:
    value = f.get("domain")
    if value is None:
        return ""
    if not isinstance(value, str) or not re.fullmatch(DOMAIN_PATTERN, value):
        raise invalid(
            "'domain' must name an n-gram table: letters, digits, '.', '_' or '-', at most 64, "
            f"starting with a letter or digit; got {shown(value)}",
            "domain",
        )
    return value


def _model(f: Fields) -> str | None:
    model = f.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {shown(model)}", "model")
    return model


def parse_completion(body: dict[str, Any], vocab_size: int) -> CompletionRequest:
    check_completion_fields(body)
    f = Fields(body)
    if f.integer("best_of", 1, 1, 2**31 - 1) != 1:
        raise invalid(
            f"best_of > 1 is not supported (no ranking of candidates); n up to {MAX_N} is",
            "best_of",
            code="unsupported_parameter",
        )
    logprobs = f.integer("logprobs", None, 0, MAX_LOGPROBS)
    echo = f.boolean("echo", False)
    if echo and logprobs is not None:
        raise invalid("'echo' together with 'logprobs' is not supported", "echo")
    max_tokens = f.integer("max_tokens", None, 1, 2**31 - 1)
    return CompletionRequest(
        model=_model(f),
        prompt=_prompt(body.get("prompt"), vocab_size),
        echo=echo,
        params=_common(f, max_tokens, logprobs),
    )


def _prompt(value: Any, vocab_size: int) -> str | list[int]:
    if value is None:
        raise invalid("'prompt' is required", "prompt")
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        if len(value) != 1:
            raise invalid("only one prompt per request is supported", "prompt")
        value = value[0]
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise invalid(
            "'prompt' must be a string, a list of token ids or a list of one of those", "prompt"
        )
    if not value:
        raise invalid("'prompt' is empty", "prompt")
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(
            f"token id {bad} in 'prompt' is outside the vocabulary ({vocab_size})", "prompt"
        )
    return value


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    check_chat_fields(body)
    f = Fields(body)
    want_logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    max_tokens = f.integer("max_completion_tokens", None, 1, 2**31 - 1)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", None, 1, 2**31 - 1)
    return ChatRequest(
        model=_model(f),
        messages=parse_messages(body.get("messages")),
        params=_common(f, max_tokens, (top or 0) if want_logprobs else None),
        tools=tools_of(body),
    )
