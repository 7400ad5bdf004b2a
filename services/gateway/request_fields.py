"""Which fields of a request body Skiff takes, per endpoint; nothing is ignored silently.

Every field of a body is one of:
- read: parsed by request_params.py and honoured (OpenAI's fields and Skiff's extensions);
- ignored: accepted and without effect, where OpenAI's own documentation gives the field no
  effect on the output (`IGNORED` says why for each);
- not yet: a feature Skiff lacks (logit_bias, audio, ...), accepted only at the value
  that asks for nothing (absent, null, `[]`, `{"type": "text"}`, ...), else a 400 naming it;
- anything else: a 400 naming the field (a typo such as `max_tokenz` must not pass unnoticed).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from services.gateway.errors import invalid
from services.gateway.structured import FIELDS as STRUCTURED
from services.gateway.tools import FIELDS as TOOLS

# OpenAI's fields read by request_params.py for both endpoints.
_COMMON = (
    "model",
    "n",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
)
# Skiff's extensions (vLLM's names, where vLLM has one).
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "domain")
# structured output (services/gateway/structured.py): OpenAI's response_format, llama-server's
# grammar and json_schema, vLLM's guided_*; on both endpoints, as vLLM takes them
# tool calls (services/gateway/tools.py): tools, tool_choice, parallel_tool_calls; chat only

COMPLETION_READ = frozenset(
    (*_COMMON, *EXTENSIONS, *STRUCTURED, "prompt", "max_tokens", "logprobs", "echo", "best_of")
)
CHAT_READ = frozenset(
    (
        *_COMMON,
        *EXTENSIONS,
        *STRUCTURED,
        *TOOLS,
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
    )
)

# Accepted and ignored, with the reason (from OpenAI's API reference).
IGNORED: Mapping[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; no effect on the output",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring (user's successor)",
    "store": "stores the output for OpenAI's distillation and evals products; Skiff stores none",
    "metadata": "tags for stored completions (see store)",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; Skiff's prefix cache "
    "matches prompts by their tokens",
}
COMPLETION_IGNORED = frozenset({"user"})  # the legacy endpoint has no other such field
CHAT_IGNORED = frozenset(IGNORED)
STREAM_OPTIONS_READ = frozenset({"include_usage"})
STREAM_OPTIONS_IGNORED = frozenset({"include_obfuscation"})  # Skiff never pads its chunks

# -- not yet: accepted only when they ask for nothing -------------------------------------------
# Each check gets the field's value (never None: null means "absent") and returns why the
# request is refused, or None.
Check = Callable[[Any], str | None]


def _none_but(*off: Any, why: str) -> Check:
    return lambda value: None if value in off else why


CHAT_NOT_YET: Mapping[str, Check] = {
    # OpenAI's deprecated forms of tools and tool_choice
    "functions": _none_but([], why="'functions' is deprecated and not supported: use 'tools'"),
    "function_call": _none_but(
        "none", "auto", why="'function_call' is deprecated and not supported: use 'tool_choice'"
    ),
    "logit_bias": _none_but({}, why="'logit_bias' is not supported yet"),
    "modalities": _none_but(["text"], why="only the text modality is supported"),
    "audio": _none_but(why="audio output is not supported"),
    "prediction": _none_but(why="predicted outputs ('prediction') are not supported yet"),
    "reasoning_effort": _none_but(why="'reasoning_effort' is not supported for this model"),
    "verbosity": _none_but(why="'verbosity' is not supported yet"),
    "web_search_options": _none_but(why="web search is not supported"),
    "service_tier": _none_but(
        "auto", "default", why="Skiff has one service tier: 'service_tier' takes auto or default"
    ),
}
COMPLETION_NOT_YET: Mapping[str, Check] = {
    "logit_bias": CHAT_NOT_YET["logit_bias"],
    "suffix": _none_but("", why="'suffix' (text insertion) is not supported yet"),
}


def check_completion_fields(body: dict[str, Any]) -> None:
    _check(body, COMPLETION_READ | COMPLETION_IGNORED, COMPLETION_NOT_YET)


def check_chat_fields(body: dict[str, Any]) -> None:
    _check(body, CHAT_READ | CHAT_IGNORED, CHAT_NOT_YET)


def _check(body: dict[str, Any], accepted: frozenset[str], not_yet: Mapping[str, Check]) -> None:
    for name in body:
        if name not in accepted and name not in not_yet:
            raise _unknown(name, accepted | not_yet.keys())
    for name, check in not_yet.items():  # in the table's order: tools before tool_choice
        value = body.get(name)
        why = None if value is None else check(value)
        if why is not None:
            raise invalid(why, name, code="unsupported_parameter")
    options = body.get("stream_options")
    if isinstance(options, dict):
        known = STREAM_OPTIONS_READ | STREAM_OPTIONS_IGNORED
        for name in options:
            if name not in known:
                raise _unknown(name, known, "stream_options.")


def _unknown(name: str, known: frozenset[str], prefix: str = "") -> Exception:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return invalid(
        f"Unknown parameter: '{prefix}{name}'{hint}", f"{prefix}{name}", code="unknown_parameter"
    )
