"""A request's tools against a model's chat template (services/gateway/tools.py), without
processes: templates without tool support are a 400 naming 'tools'; tool_choice decides parsing
and grammar; the grammar that forces calls, compiled over SmolLM2's vocabulary, takes exactly
the calls it should (the function, its schema, how many); messages keep their tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.chat_messages import parse_messages
from services.gateway.errors import ApiError
from services.gateway.served_model import ServedModel
from services.gateway.tool_calls import HERMES, LLAMA3_JSON, HermesParser, Llama3JsonParser
from services.gateway.tools import call_grammar, plan_tools, tools_of
from shared.grammar import GrammarCompiler
from shared.tokenizer import ChatTemplate
from tests.gateway.tool_templates import HERMES as HERMES_TEMPLATE
from tests.gateway.tool_templates import LLAMA3_JSON as LLAMA3_TEMPLATE

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {  # a $ref into $defs: the definitions must move with the parameters
    "$defs": {"zone": {"type": "string", "maxLength": 8}},
    "type": "object",
    "properties": {"tz": {"$ref": "#/$defs/zone"}},
    "required": ["tz"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
USER = [{"role": "user", "content": "hi"}]


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _request(**fields: Any):
    return tools_of({"tools": TOOLS, **fields})


def _refused(fn, *args) -> dict:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    assert exc.value.status == 400
    return exc.value.body()["error"]


def test_templates_without_tool_support_are_refused(model: ServedModel) -> None:
    err = _refused(plan_tools, _request(), model.chat_template, USER)  # SmolLM2's own
    assert err["param"] == "tools" and "no tool support" in err["message"], err
    assert model.chat_template.model_name in err["message"]
    err = _refused(plan_tools, _request(), ChatTemplate(None, model_name="m"), USER)
    assert err["param"] == "tools" and "no chat template" in err["message"], err
    odd = ChatTemplate("{% for t in tools %}{{ t | tojson }}{% endfor %}[CALLS]", model_name="m")
    err = _refused(plan_tools, _request(), odd, USER)
    assert err["param"] == "tools" and "format Skiff does not parse" in err["message"], err
    # earlier calls in the conversation need a template that renders them
    history = parse_messages([*USER, {"role": "assistant", "tool_calls": [_call("get_time")]}])
    err = _refused(plan_tools, None, model.chat_template, history)
    assert err["param"] == "messages[1].tool_calls", err
    # without tools or calls, nothing changes for SmolLM2
    plan = plan_tools(None, model.chat_template, USER)
    assert (plan.template_vars, plan.grammar, plan.parser) == ({}, "", None)


@pytest.mark.parametrize(
    ("template", "parser"), [(HERMES_TEMPLATE, HermesParser), (LLAMA3_TEMPLATE, Llama3JsonParser)]
)
def test_tool_choice_decides_parsing_and_grammar(template: str, parser: type) -> None:
    t = ChatTemplate(template)
    auto = plan_tools(_request(), t, USER)
    assert auto.template_vars == {"tools": TOOLS} and auto.grammar == ""
    made = auto.parser()
    assert isinstance(made, parser) and made.names == {"get_weather", "get_time"}
    none = plan_tools(_request(tool_choice="none"), t, USER)
    assert none.template_vars == {"tools": TOOLS} and none.parser is None and none.grammar == ""
    for choice in ("required", _named("get_time")):
        forced = plan_tools(_request(tool_choice=choice), t, USER)
        assert forced.grammar and isinstance(forced.parser(), parser)
    assert tools_of({"tools": [], "tool_choice": "auto"}) is None


@pytest.fixture(scope="module")
def compiler(model: ServedModel) -> GrammarCompiler:
    return GrammarCompiler(model.tokenizer, model.tokenizer.vocab_size)


def _takes(compiler: GrammarCompiler, model: ServedModel, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (as the tokens SmolLM2 reads it as)."""
    matcher = compiler.compile(grammar).matcher
    ids = model.tokenizer.encode(text, add_special=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def _hermes(name: str, args: dict) -> str:
    call = json.dumps({"name": name, "arguments": args})
    return f"<tool_call>\n{call}\n</tool_call>"


W = ("get_weather", {"city": "Paris", "unit": "celsius"})
T = ("get_time", {"tz": "UTC"})


def test_forced_calls_grammar(compiler: GrammarCompiler, model: ServedModel) -> None:
    def takes(fields: dict, text: str) -> bool:
        return _takes(compiler, model, call_grammar(HERMES, _request(**fields)), text)

    named = {"tool_choice": _named("get_weather")}
    assert takes(named, _hermes(*W))
    assert not takes(named, _hermes(*T))  # another function
    assert not takes(named, _hermes(*W) + "\n" + _hermes(*W))  # one call only
    assert not takes(named, _hermes("get_weather", {"city": "Paris", "unit": "kelvin"}))
    assert not takes(named, _hermes("get_weather", {"city": "Paris"}))  # required property
    assert not takes(named, "Sure! " + _hermes(*W))  # no text around the call
    required = {"tool_choice": "required"}
    assert takes(required, _hermes(*T)) and takes(required, _hermes(*W))
    assert takes(required, _hermes(*W) + "\n" + _hermes(*T))  # parallel calls
    assert not takes(required, "")
    assert not takes(required, _hermes("get_time", {"tz": "Europe/Paris"}))  # $defs maxLength
    single = {"tool_choice": "required", "parallel_tool_calls": False}
    assert takes(single, _hermes(*T)) and not takes(single, _hermes(*T) + "\n" + _hermes(*T))
    # Llama 3 JSON: {"name", "parameters"}, parallel calls joined by "; "
    llama = call_grammar(LLAMA3_JSON, _request(**required))
    one = json.dumps({"name": "get_time", "parameters": {"tz": "UTC"}})
    assert _takes(compiler, model, llama, one)
    assert _takes(compiler, model, llama, f"{one}; {one}")
    assert not _takes(compiler, model, llama, _hermes(*T))


def test_grammar_errors_name_tools() -> None:
    odd = {"type": "object", "properties": {"a": {"type": "string", "format": "odd"}}}
    fn = {"name": "f", "parameters": odd, "strict": True}  # strict: no keyword skipped
    req = tools_of({"tools": [{"type": "function", "function": fn}], "tool_choice": "required"})
    err = _refused(call_grammar, HERMES, req)
    assert err["param"] == "tools" and "do not compile" in err["message"], err
    fn["strict"] = False
    assert call_grammar(HERMES, req)


def _call(name: str, arguments: Any = '{"tz": "UTC"}', **extra: Any) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments},
            **extra}  # fmt: skip


def test_messages_keep_tool_calls_for_the_template() -> None:
    msgs = parse_messages(
        [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [_call("get_time")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ]
    )
    assert msgs[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
        ],
    }  # fmt: skip
    assert msgs[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    text = ChatTemplate(HERMES_TEMPLATE).render(msgs, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text


@pytest.mark.parametrize(
    ("message", "param", "words"),
    [
        ({"role": "assistant", "tool_calls": [_call("f", "{oops")]},
         "messages[1].tool_calls[0].function.arguments", "not JSON"),
        ({"role": "assistant", "tool_calls": [_call("f", "[1]")]},
         "messages[1].tool_calls[0].function.arguments", "JSON object"),
        ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
         "messages[1].tool_calls[0].id", "string"),
        ({"role": "assistant", "tool_calls": {"id": "x"}}, "messages[1].tool_calls", "list"),
        ({"role": "user", "content": "x", "tool_calls": [_call("f")]}, "messages[1].tool_calls",
         "only assistant"),
        ({"role": "tool", "content": "12:00"}, "messages[1].tool_call_id", "needs the id"),
    ],
)  # fmt: skip
def test_bad_tool_messages_are_refused(message: dict, param: str, words: str) -> None:
    err = _refused(parse_messages, [*USER, message])
    assert err["param"] == param and words in err["message"], err
