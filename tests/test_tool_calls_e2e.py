"""Tool calls through the real processes (a gateway and a CPU worker), driven with the official
openai SDK. SmolLM2's own template has no tool support: `tools` gets a 400 naming it. A copy of
SmolLM2 whose GGUF carries a Hermes tool template (tests/gateway/tool_templates.py) round-trips:
a forced call (a named function, then `required`) comes back as `tool_calls` whose arguments
validate against the function's schema, streamed deltas add up to the same call, and the tool's
result sent back as a `role: tool` message gets an assistant answer. Auto mode may or may not
call with a model this small: it answers 200 with content or well-formed calls (its parsing is
tested in tests/gateway/test_tool_calls.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import jsonschema
import pytest

from tests.cluster import Cluster
from tests.gateway.tool_templates import HERMES

openai = pytest.importorskip("openai")

WORKER_ARGS = ("--max-model-len", "2048", "--max-batch-tokens", "256")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a timezone",
            "parameters": TIME,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of a GGUF file with another `tokenizer.chat_template` (tensors as they are)."""
    reader = gguf.GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in (
            "general.architecture",
            "tokenizer.chat_template",
        ):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    writer.add_chat_template(template)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst


@pytest.fixture(scope="module")
def tools_model(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("tools") / "SmolLM2-tools.gguf"
    return with_chat_template(smollm2_path, dst, HERMES)


@pytest.fixture(scope="module")
def cluster(tools_model: Path):
    c = Cluster(tools_model, n_workers=1, worker_args=WORKER_ARGS).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_round_trip(client, tools_model: Path) -> None:
    model = tools_model.stem
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = _check_call(call)
    # streamed: the same call, in delta.tool_calls entries
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=named,
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert json.loads(deltas[0].function.arguments) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool's result goes back; the model answers in text
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=24,
    )
    answer = r.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert not answer.message.tool_calls


def test_required_n_choices_and_auto(client, tools_model: Path) -> None:
    model = tools_model.stem
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
        temperature=0.8,
        seed=3,
        max_tokens=60,
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        _check_call(call)
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            _check_call(call)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_a_template_without_tools_is_a_400(smollm2_path: Path) -> None:
    # checked at the gateway, before any worker: a gateway on SmolLM2's own file, no worker
    plain = Cluster(smollm2_path, n_workers=0).start()
    try:
        c = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none", max_retries=0)
        _wait_http(plain)
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=smollm2_path.stem, messages=ASK, tools=TOOLS)
        err = exc.value.body
        assert err["param"] == "tools" and "no tool support" in err["message"], err
    finally:
        plain.stop()


def _wait_http(c: Cluster) -> None:
    for _ in range(200):
        if c.health()[0]:
            return
        time.sleep(0.1)
    raise TimeoutError("the gateway did not answer")
