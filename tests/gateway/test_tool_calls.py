"""The tool-call parsers (services/gateway/tool_calls.py) and the delta adapter
(tool_deltas.py), without processes: whole outputs split into content and calls, the same
split however the text is cut into stream deltas, text that is not a valid call kept as
content, formats told from chat templates."""

from __future__ import annotations

import json
import random

import pytest

from services.gateway.generation import Delta, TokenLogprob
from services.gateway.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    format_of,
    parse_whole,
)
from services.gateway.tool_deltas import ChoiceCalls
from tests.gateway.tool_templates import HERMES as HERMES_TEMPLATE
from tests.gateway.tool_templates import LLAMA3_JSON as LLAMA3_TEMPLATE

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
PLAIN = "Plain text, a < sign and <tool_ half a marker "


def _hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def _calls(calls: list[ToolCall]) -> list[tuple[int, str, dict]]:
    return [(c.index, c.name, json.loads(c.arguments)) for c in calls]


HERMES_CASES = [
    # (output, content, calls as (index, name, arguments))
    (_hermes(WEATHER), "", [(0, "get_weather", {"city": "Paris", "unit": "celsius"})]),
    (
        f"Let me look.\n{_hermes(WEATHER)}\n{_hermes(TIME)}\n",
        "Let me look.",
        [(0, "get_weather", {"city": "Paris", "unit": "celsius"}), (1, "get_time", {"tz": "UTC"})],
    ),
    (PLAIN, PLAIN, []),
    # not calls: a function the request did not offer, JSON that is not JSON, not an object
    (_hermes('{"name": "rm_rf", "arguments": {}}'), _hermes('{"name": "rm_rf", "arguments": {}}'),
     []),
    (_hermes('{"name": "get_time", "arguments": {'), _hermes('{"name": "get_time", "arguments": {'),
     []),
    (_hermes('["get_time"]'), _hermes('["get_time"]'), []),
    # the end marker dropped at the end of the output: a complete call still counts
    ("<tool_call>\n" + TIME, "", [(0, "get_time", {"tz": "UTC"})]),
    # cut mid-call (a length limit): the text, as content
    ("<tool_call>\n" + TIME[:20], "<tool_call>\n" + TIME[:20], []),
    # arguments as a JSON string, and Llama's key
    (_hermes('{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}'), "",
     [(0, "get_time", {"tz": "CET"})]),
    (_hermes('{"name": "get_time", "parameters": {"tz": "CET"}}'), "",
     [(0, "get_time", {"tz": "CET"})]),
    (f"{_hermes(TIME)} and then some text", "and then some text", [(0, "get_time", {"tz": "UTC"})]),
]  # fmt: skip

LLAMA_TIME = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
LLAMA_CASES = [
    (LLAMA_TIME, "", [(0, "get_time", {"tz": "UTC"})]),
    (f"<|python_tag|>{LLAMA_TIME}", "", [(0, "get_time", {"tz": "UTC"})]),
    (
        f"  {LLAMA_TIME}; {LLAMA_TIME.replace('UTC', 'CET')}",
        "",
        [(0, "get_time", {"tz": "UTC"}), (1, "get_time", {"tz": "CET"})],
    ),
    ("The time is noon.", "The time is noon.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ('{"name": "get_time", "parameters": {"tz"', '{"name": "get_time", "parameters": {"tz"', []),
    (f"{LLAMA_TIME} done.", "done.", [(0, "get_time", {"tz": "UTC"})]),
]


def _streamed(parser, text: str, rng: random.Random) -> tuple[str, list[ToolCall]]:
    parts = []
    at = 0
    while at < len(text):
        n = rng.randint(1, 6)
        parts += parser.push(text[at : at + n])
        at += n
    parts += parser.flush()
    content = "".join(p for p in parts if isinstance(p, str))
    return content, [p for p in parts if isinstance(p, ToolCall)]


@pytest.mark.parametrize(
    ("parser", "output", "content", "calls"),
    [(HermesParser, *case) for case in HERMES_CASES]
    + [(Llama3JsonParser, *case) for case in LLAMA_CASES],
)
def test_whole_and_streamed_outputs(parser, output: str, content: str, calls: list) -> None:
    got_content, got_calls = parse_whole(parser(NAMES), output)
    assert (got_content, _calls(got_calls)) == (content, calls)
    for seed in range(5):  # cut into deltas of 1 to 6 characters: the same split
        got_content, got_calls = _streamed(parser(NAMES), output, random.Random(seed))
        assert (got_content, _calls(got_calls)) == (content, calls), seed
    assert len({c.id for c in got_calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in got_calls)


def test_content_streams_before_a_call_completes() -> None:
    p = HermesParser(NAMES)
    assert p.push("Checking the weather ") == ["Checking the weather"]  # the space is held
    assert p.push("now.") == [" now."]
    assert p.push("\n<tool") == []  # may be a call: held
    assert p.push("_call>\n" + WEATHER[:10]) == []
    (call,) = p.push(WEATHER[10:] + "\n</tool_call>")
    assert call.name == "get_weather" and p.flush() == []
    p = Llama3JsonParser(NAMES)
    assert p.push(" The") == [" The"]  # not a call: shown at once
    p = Llama3JsonParser(NAMES)
    assert p.push('{"name": "get_time", ') == [] and p.push("x") == []


def test_format_of_templates(model) -> None:
    assert format_of(HERMES_TEMPLATE) is HERMES
    assert format_of(LLAMA3_TEMPLATE) is LLAMA3_JSON
    assert format_of(model.chat_template.source) is None  # SmolLM2's own
    assert HERMES.parser is HermesParser and LLAMA3_JSON.args_key == "parameters"


def _entry(i: int) -> TokenLogprob:
    return TokenLogprob(str(i), b"x", -0.5, [], i)


def test_deltas_hold_logprobs_and_end_with_tool_calls() -> None:
    calls = ChoiceCalls(HermesParser(NAMES))
    assert calls.push(Delta("<tool_call>\n", [_entry(0)])) is None
    assert calls.push(Delta(TIME, [_entry(1)])) is None
    out = calls.push(Delta("\n</tool_call>", [_entry(2)], "stop"))
    assert out.text == "" and out.finish_reason == "tool_calls"
    assert [e.token for e in out.logprobs] == ["0", "1", "2"]  # every token's entry, in order
    assert _calls(out.tool_calls) == [(0, "get_time", {"tz": "UTC"})]
    plain = ChoiceCalls(HermesParser(NAMES))
    assert plain.push(Delta("Hi", [_entry(0)])).text == "Hi"
    out = plain.push(Delta(" there", [_entry(1)], "stop"))
    assert (out.text, out.finish_reason, out.tool_calls) == (" there", "stop", [])
    cut = ChoiceCalls(HermesParser(NAMES))
    assert cut.push(Delta("<tool_call>\n{")) is None
    out = cut.push(Delta('"na', finish_reason="length"))
    assert (out.text, out.finish_reason) == ('<tool_call>\n{"na', "length")
