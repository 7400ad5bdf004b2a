"""Tool calls through the gateway over real HTTP and ZMQ, with the official openai SDK: the
model (SmolLM2's header with a Hermes tool template) and a fake worker whose reply is a
tool call. Whole and streamed responses carry the parsed calls, n choices each theirs, the
forced choices send their grammar to the worker, the conversation with the tool's result reaches
the worker as the template renders it, and SmolLM2's own template refuses tools."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from services.gateway.served_model import ServedModel
from shared.tokenizer import ChatTemplate
from tests.gateway.tool_templates import HERMES
from tests.gateway_harness import NAME, FakeWorker, GatewayServer, http, wait_until

openai = pytest.importorskip("openai")

CALL = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
REPLY = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a timezone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "What time is it in London?"}]


@pytest.fixture(scope="module")
def tools_model(model: ServedModel) -> ServedModel:
    return dataclasses.replace(model, chat_template=ChatTemplate(HERMES, model_name="tools"))


@pytest.fixture(scope="module")
def gateway(tools_model: ServedModel) -> Iterator[tuple[GatewayServer, FakeWorker]]:
    server = GatewayServer(tools_model)
    reply = tools_model.tokenizer.encode(REPLY, add_special=False)
    worker = FakeWorker(server, "w1", reply, tools_model.tokenizer.eos_id).start()
    wait_until(lambda: http(server.url + "/health")[0] == 200, what="worker w1 ready")
    yield server, worker
    worker.stop()
    server.close()


def _ask(server: GatewayServer, **kw):
    return server.client().chat.completions.create(
        model=NAME, messages=kw.pop("messages", ASK), tools=TOOLS, max_tokens=100, **kw
    )


def _prompt_ids(model: ServedModel, messages: list[dict]) -> list[int]:
    text = model.chat_template.render(messages, add_generation_prompt=True, tools=TOOLS)
    return model.tokenizer.encode(text, add_special=False, special=True)


def test_whole_response_carries_the_calls(gateway) -> None:
    server, _ = gateway
    r = _ask(server, n=2)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_time",
            {"tz": "UTC"},
        )
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    # none: the same text is content, unparsed
    r = _ask(server, tool_choice="none")
    assert r.choices[0].message.content == REPLY and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls


def test_streamed_calls_arrive_as_deltas(gateway) -> None:
    server, _ = gateway
    chunks = list(_ask(server, stream=True, n=2))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        text = "".join(c.delta.content or "" for c in mine)
        calls = [d for c in mine for d in c.delta.tool_calls or []]
        assert text == "Let me check."
        assert [(d.index, d.type, d.function.name) for d in calls] == [(0, "function", "get_time")]
        assert json.loads(calls[0].function.arguments) == {"tz": "UTC"}
        assert [c.finish_reason for c in mine][-1] == "tool_calls"
        assert not any(c.finish_reason for c in mine[:-1])


def test_forced_choices_send_a_grammar(gateway, tools_model: ServedModel) -> None:
    server, worker = gateway
    named = {"type": "function", "function": {"name": "get_time"}}
    for i, choice in enumerate(["required", named, "auto"]):
        ask = [{"role": "user", "content": f"What time is it? ({i})"}]
        _ask(server, messages=ask, tool_choice=choice)
        ids = _prompt_ids(tools_model, ask)
        gen = worker.generate_for(lambda g, ids=ids: g.prompt_ids == ids)
        assert bool(gen.sampling.grammar) == (choice != "auto")
        if choice == named:
            assert "get_time" in gen.sampling.grammar and "<tool_call>" in gen.sampling.grammar


def test_the_tool_result_goes_back(gateway, tools_model: ServedModel) -> None:
    server, worker = gateway
    call = _ask(server).choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    _ask(server, messages=messages, tool_choice="none")
    rendered = tools_model.chat_template.render(
        [
            *ASK,
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
            {"role": "tool", "content": "12:00"},
        ],
        add_generation_prompt=True,
        tools=TOOLS,
    )  # fmt: skip
    assert f"<tool_call>\n{CALL}\n</tool_call>" in rendered
    ids = tools_model.tokenizer.encode(rendered, add_special=False, special=True)
    worker.generate_for(lambda g: g.prompt_ids == ids)


def test_a_template_without_tools_refuses_them(served, model: ServedModel) -> None:
    server, _ = served  # SmolLM2's own template
    assert "tools" not in model.chat_template.source
    with pytest.raises(openai.BadRequestError) as exc:
        _ask(server)
    err = exc.value.body
    assert err["param"] == "tools" and "no tool support" in err["message"], err
    # without tools the same conversation is served as before
    out = server.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=5)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
