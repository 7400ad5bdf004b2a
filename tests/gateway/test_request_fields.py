"""Which request fields the gateway takes (services/gateway/request_fields.py), checked at the
parsing level without processes: every field Skiff does not implement is a 400 naming it, the
fields it reads or ignores pass, and the tables match what request_params.py reads."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from services.gateway import request_params
from services.gateway.errors import ApiError
from services.gateway.request_fields import (
    CHAT_IGNORED,
    CHAT_NOT_YET,
    CHAT_READ,
    COMPLETION_IGNORED,
    COMPLETION_NOT_YET,
    COMPLETION_READ,
    EXTENSIONS,
    IGNORED,
)
from services.gateway.request_params import MAX_N, parse_chat, parse_completion
from services.gateway.structured import FIELDS as STRUCTURED
from services.gateway.tools import FIELDS as TOOLS

VOCAB = 1000
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
# strict: a keyword the grammar compiler lacks is an error, not skipped
_ODD = {"type": "object", "properties": {"a": {"type": "string", "format": "odd"}}}
STRICT_UNKNOWN = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": _ODD, "strict": True},
}


def _parse(endpoint: str, extra: dict[str, Any]) -> Any:
    if endpoint == "chat":
        return parse_chat({"messages": MSGS, **extra})
    return parse_completion({"prompt": "a", **extra}, VOCAB)


REFUSED = [
    # (endpoint, extra fields, the error's param, words its message must hold)
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ("chat", {"response_format": "json"}, "response_format", "'type' must be"),
    ("chat", {"response_format": STRICT_UNKNOWN}, "response_format", "does not compile"),
    ("chat", {"guided_regex": "(("}, "guided_regex", "does not compile"),
    ("chat", {"grammar": "root ::= missing"}, "grammar", "missing"),
    ("chat", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("chat", {"guided_json": "{not json"}, "guided_json", "not JSON"),
    ("chat", {"response_format": SCHEMA, "guided_regex": "a+"}, "guided_regex", "one field"),
    ("chat", {"tools": TOOL}, "tools", "must be a list"),
    ("chat", {"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    ("chat", {"tools": [{"type": "code", "function": {}}]}, "tools[0]", "type 'function'"),
    ("chat", {"tools": [{**TOOL, "function": {"name": "a b"}}]}, "tools[0].function.name", "64"),
    ("chat", {"tools": [TOOL, TOOL]}, "tools[1].function.name", "offered twice"),
    (
        "chat",
        {"tools": [{**TOOL, "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
        "JSON object",
    ),
    ("chat", {"tools": [TOOL], "tool_choice": "any"}, "tool_choice", "none, auto, required"),
    ("chat", {"tools": [TOOL], "tool_choice": _named("g")}, "tool_choice", "does not offer"),
    ("chat", {"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "'tools' offers none"),
    ("chat", {"tool_choice": _named("f")}, "tool_choice", "'tools' offers none"),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": "required", "response_format": SCHEMA},
        "response_format",
        "cannot be combined",
    ),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": _named("f"), "guided_regex": "a"},
        "guided_regex",
        "cannot be combined",
    ),
    (
        "chat",
        {"functions": [{"name": "f"}]},
        "functions",
        "deprecated and not supported: use 'tools'",
    ),
    ("chat", {"function_call": {"name": "f"}}, "function_call", "use 'tool_choice'"),
    ("chat", {"logit_bias": {"42": -100}}, "logit_bias", "not supported"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities", "text modality"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction", ""),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort", ""),
    ("chat", {"verbosity": "low"}, "verbosity", ""),
    ("chat", {"web_search_options": {}}, "web_search_options", "web search"),
    ("chat", {"service_tier": "priority"}, "service_tier", "auto or default"),
    ("chat", {"max_tokenz": 5}, "max_tokenz", "did you mean 'max_tokens'"),
    ("chat", {"n": MAX_N + 1}, "n", f"between 1 and {MAX_N}"),
    ("chat", {"n": 0}, "n", ""),
    ("chat", {"best_of": 2}, "best_of", "Unknown parameter"),  # not a chat field
    ("chat", {"echo": True}, "echo", "Unknown parameter"),
    ("chat", {"min_tokens": 4}, "min_tokens", "Unknown parameter"),  # vLLM's, not Skiff's
    ("chat", {"chat_template_kwargs": {}}, "chat_template_kwargs", "Unknown parameter"),
    (
        "chat",
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
        "Unknown parameter",
    ),
    ("completion", {"best_of": 2}, "best_of", "best_of > 1 is not supported"),
    ("completion", {"best_of": 4, "n": 4}, "best_of", "best_of > 1"),
    ("completion", {"n": MAX_N + 1}, "n", f"between 1 and {MAX_N}"),
    ("completion", {"suffix": "}"}, "suffix", "not supported yet"),
    ("completion", {"logit_bias": {"42": 5}}, "logit_bias", "not supported"),
    ("completion", {"tools": [TOOL]}, "tools", "Unknown parameter"),  # not a completion field
    ("completion", {"json_schema": [1]}, "json_schema", "must be a JSON object"),
    ("completion", {"store": True}, "store", "Unknown parameter"),
    ("completion", {"max_tokenz": 5}, "max_tokenz", "did you mean 'max_tokens'"),
    ("completion", {"temprature": 0.5}, "temprature", "did you mean 'temperature'"),
]


@pytest.mark.parametrize(("endpoint", "extra", "param", "words"), REFUSED)
def test_unsupported_fields_are_refused(
    endpoint: str, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(ApiError) as exc:
        _parse(endpoint, extra)
    err = exc.value.body()["error"]
    assert exc.value.status == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert words in err["message"], err


ACCEPTED = [
    # (endpoint, extra fields): each parses; read fields take effect, the others none
    ("chat", {"user": "u1", "safety_identifier": "s", "store": False, "metadata": {"k": "v"}}),
    ("chat", {"prompt_cache_key": "k", "service_tier": "auto"}),
    ("chat", {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}),
    ("chat", {"tools": None, "tool_choice": "auto", "parallel_tool_calls": False}),
    ("chat", {"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": True}),
    ("chat", {"tools": [TOOL], "tool_choice": _named("f"), "parallel_tool_calls": None}),
    ("chat", {"tools": [TOOL], "tool_choice": "none", "response_format": SCHEMA}),
    ("chat", {"functions": [], "function_call": "none", "logit_bias": {}}),
    ("chat", {"modalities": ["text"], "audio": None, "prediction": None}),
    ("chat", {"reasoning_effort": None, "verbosity": None, "web_search_options": None}),
    ("chat", {"stream": True, "stream_options": {"include_obfuscation": False}}),
    ("chat", {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1}),
    ("chat", {"ignore_eos": True, "domain": "sql", "n": MAX_N}),
    ("completion", {"user": "u1", "suffix": "", "logit_bias": {}, "best_of": 1}),
    ("completion", {"suffix": None, "n": MAX_N, "echo": True}),
    ("chat", {"response_format": SCHEMA}),
    ("chat", {"response_format": {"type": "json_object"}}),
    ("chat", {"response_format": {**SCHEMA, "json_schema": {"name": "x", "schema": _ODD}}}),
    ("completion", {"response_format": {"type": "text"}}),
    ("completion", {"grammar": 'root ::= "yes" | "no"', "guided_json": None}),
    ("completion", {"guided_regex": "[a-z]+", "json_schema": None}),
    ("completion", {"guided_choice": ["red", "blue"]}),
    ("completion", {"guided_grammar": 'start: "a"+'}),
    ("completion", {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True}),
]


@pytest.mark.parametrize(("endpoint", "extra"), ACCEPTED)
def test_accepted_fields(endpoint: str, extra: dict[str, Any]) -> None:
    req = _parse(endpoint, extra)
    assert req.params.n == extra.get("n", 1)
    if "top_k" in extra:
        assert req.params.sampling.top_k == 5 and req.params.sampling.min_p == 0.1


def test_every_read_field_parses_together() -> None:
    chat = {
        "model": "m",
        "messages": MSGS,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        "top_p": 0.9,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "seed": 3,
        "stop": ["\n"],
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
        "ignore_eos": True,
        "domain": "code",
        "max_tokens": 9,
        "max_completion_tokens": 8,
        "logprobs": True,
        "top_logprobs": 2,
    }
    # structured output takes one field at a time: each of them is in ACCEPTED; tools too
    assert set(chat) | set(STRUCTURED) | set(TOOLS) == CHAT_READ
    params = parse_chat(chat).params
    assert (params.n, params.max_tokens, params.sampling.seed, params.domain) == (2, 8, 3, "code")
    assert params.include_usage and params.ignore_eos and params.sampling.logprobs == 2
    completion = {k: v for k, v in chat.items() if k in COMPLETION_READ}
    completion |= {"prompt": [1, 2], "logprobs": 3, "echo": False, "best_of": 1}
    assert set(completion) | set(STRUCTURED) == COMPLETION_READ
    req = parse_completion(completion, VOCAB)
    assert req.prompt == [1, 2] and req.params.sampling.logprobs == 3 and req.params.n == 2


def _fields_request_params_reads() -> set[str]:
    """The names request_params.py asks of a body: `f.<getter>("name")` and
    `body.get("name")` (message and content-part fields are read from other objects)."""
    tree = ast.parse(Path(request_params.__file__).read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in ("f", "body")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    }


def test_tables_match_what_is_read() -> None:
    # the structured-output fields are read by structured.py (its FIELDS), tools by tools.py
    read = _fields_request_params_reads() | set(STRUCTURED) | set(TOOLS)
    assert read == CHAT_READ | COMPLETION_READ
    assert set(EXTENSIONS) <= CHAT_READ & COMPLETION_READ
    assert COMPLETION_IGNORED <= CHAT_IGNORED == set(IGNORED)
    for read, ignored, not_yet in (
        (CHAT_READ, CHAT_IGNORED, CHAT_NOT_YET),
        (COMPLETION_READ, COMPLETION_IGNORED, COMPLETION_NOT_YET),
    ):
        assert not read & ignored and not read & set(not_yet) and not ignored & set(not_yet)
