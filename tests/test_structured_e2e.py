"""Structured output through the real processes (a gateway and a CPU worker serving SmolLM2),
driven with the official openai SDK: JSON-schema requests over varied schemas (nested objects,
enums, arrays, required fields; 24 in CI, 200 with `pytest -m long`) all answer JSON that
parses and validates (jsonschema); json_object answers an object; a GBNF grammar, a regex and a
choice are matched; streamed deltas add up to the same constrained text; n = 2 choices both
match; a length limit that cuts the output says "length". Whether a constrained request changes
the greedy tokens of the requests beside it is tested in the engine, where the batches are the
same run to run (tests/test_structured_engine.py)."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from tests.cluster import Cluster

openai = pytest.importorskip("openai")

WORKER_ARGS = ("--max-model-len", "2048", "--max-batch-tokens", "256")
SIZES = {"ci": 24, "full": 200}
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path):
    c = Cluster(smollm2_path, n_workers=1, worker_args=WORKER_ARGS).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=300)


def _leaf(rng: random.Random) -> dict:
    return rng.choice(
        [
            {"type": "string", "maxLength": rng.randint(3, 16)},
            {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 100, 5000])},
            {"type": "number", "minimum": -10, "maximum": 10},
            {"type": "boolean"},
            {"enum": rng.sample(["red", "green", "blue", "cyan", "black"], rng.randint(2, 4))},
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": rng.randint(1, 4),
            },  # fmt: skip
        ]
    )


def schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties: leaves, arrays of leaves, nested objects (two levels
    at most); some properties required, no others allowed."""
    names = rng.sample(["name", "city", "count", "score", "ok", "color", "items", "meta"], 4)
    props = {}
    for name in names[: rng.randint(1, 4)]:
        kind = rng.random()
        if kind < 0.2 and depth < 2:
            props[name] = schema(rng, depth + 1)
        elif kind < 0.35:
            props[name] = {"type": "array", "items": _leaf(rng), "maxItems": 3}
        else:
            props[name] = _leaf(rng)
    required = [n for n in props if rng.random() < 0.7] or [next(iter(props))]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not JSON ({exc}): {text!r}") from None


def _ask(client, model: str, body: dict, **kw):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": body.pop("content")}],
        max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        temperature=kw.pop("temperature", 0),
        **body,
        **kw,
    )


@pytest.mark.parametrize("size", ["ci", pytest.param("full", marks=pytest.mark.long)])
def test_json_schemas_parse_and_validate(client, smollm2_path: Path, size: str) -> None:
    rng = random.Random(11)
    schemas = [schema(rng) for _ in range(SIZES[size])]
    topics = ["a customer", "a city", "an order", "a sensor reading", "a book", "a game"]

    def one(i: int):
        s = schemas[i]
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}}
        content = f"Describe {topics[i % len(topics)]} as JSON."
        seeded = {"temperature": 0.8, "seed": i} if i % 3 == 2 else {}
        return _ask(
            client, smollm2_path.stem, {"content": content, "response_format": fmt}, **seeded
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(len(schemas))))
    for s, r in zip(schemas, answers, strict=True):
        (choice,) = r.choices
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
        jsonschema.validate(_json(choice.message.content), s)


def test_json_object_grammar_regex_and_choice(client, smollm2_path: Path) -> None:
    model = smollm2_path.stem
    ask = {"content": "A JSON object about Paris.", "response_format": {"type": "json_object"}}
    r = _ask(client, model, ask, max_tokens=600)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by the limit: a prefix of an object
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content.startswith("{")
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    r = _ask(client, model, {"content": "Is the sky blue?", "extra_body": {"grammar": gbnf}})
    assert re.fullmatch(r"The answer is (yes|no)\.", r.choices[0].message.content)
    regex = r"[A-Z][a-z]{2,9}, [0-9]{4}"
    r = _ask(
        client, model, {"content": "A city and a year.", "extra_body": {"guided_regex": regex}}
    )
    assert re.fullmatch(regex, r.choices[0].message.content)
    choices = ["Paris", "Rome", "Berlin"]
    r = _ask(client, model, {"content": "Capital of Italy?",
                             "extra_body": {"guided_choice": choices}})  # fmt: skip
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"


def test_streamed_n_choices_and_a_cut_output(client, smollm2_path: Path) -> None:
    model = smollm2_path.stem
    s = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
         "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
         "required": ["city", "year"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": s}}
    body = {"content": "A city and a year as JSON.", "response_format": fmt}
    whole = _ask(client, model, dict(body)).choices[0].message.content
    chunks = _ask(client, model, dict(body), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    r = _ask(client, model, dict(body), n=2, temperature=0.9, seed=5)
    assert len(r.choices) == 2
    for choice in r.choices:
        jsonschema.validate(_json(choice.message.content), s)
    r = _ask(client, model, dict(body), max_tokens=3)
    assert r.choices[0].finish_reason == "length" and whole.startswith(r.choices[0].message.content)
