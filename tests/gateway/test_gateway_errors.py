"""Gateway error handling over real HTTP: OpenAI-style 4xx bodies naming the bad parameter,
malformed bodies, a model without a chat template, no worker, API keys, tokenize/detokenize."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway.served_model import ServedModel
from shared.tokenizer import ChatTemplate
from tests.gateway_harness import CHAT, COMP, MAX_MODEL_LEN, MSGS, NAME, REPLY, assert_error, http

openai = pytest.importorskip("openai")

# -- errors ---------------------------------------------------------------------------------------

ERROR_CASES = [
    # (path, body, status, param)
    (COMP, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    (COMP, {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
    (COMP, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    (COMP, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    (COMP, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "a", "temperature": -1}, 400, "temperature"),
    (COMP, {"prompt": "a", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "a", "top_k": -2}, 400, "top_k"),
    (COMP, {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMP, {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "a", "seed": 1.5}, 400, "seed"),
    (COMP, {"prompt": "a", "n": 17}, 400, "n"),
    (COMP, {"prompt": "a", "best_of": 2}, 400, "best_of"),
    (COMP, {"prompt": "a", "max_tokenz": 2}, 400, "max_tokenz"),
    (COMP, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (COMP, {"prompt": "a", "stop": 5}, 400, "stop"),
    (COMP, {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMP, {"prompt": ["a", "b"]}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    (COMP, {"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt"),
    (COMP, {"max_tokens": 4}, 400, "prompt"),
    (COMP, {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    (CHAT, {"messages": MSGS, "n": 17}, 400, "n"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json"}}, 400, "response_format"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    (
        CHAT,
        {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),  # SmolLM2's template has no tool support
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "logprobs": "yes"}, 400, "logprobs"),
    (CHAT, {"messages": MSGS, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES)
def test_request_errors(served, path: str, body: dict, status: int, param: str | None) -> None:
    server, _ = served
    err = assert_error(*http(server.url + path, body), status, param)
    if status == 404:
        assert err["code"] == "model_not_found"
    else:
        assert err["type"] == "invalid_request_error"


def test_malformed_bodies_and_extras(served) -> None:
    server, _ = served
    assert_error(*http(server.url + COMP, raw=b'{"prompt": "a",'), 400)
    assert_error(*http(server.url + CHAT, raw=b"[1, 2]"), 400)
    err = assert_error(*http(server.url + COMP, {"prompt": "a", "max_tokens": 4000}), 400)
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]
    # Unknown fields are refused, fields without effect (`user`) accepted; `model` may be omitted.
    err = assert_error(*http(server.url + COMP, {"prompt": "a", "frobnicate": 1}), 400)
    assert err["param"] == "frobnicate" and err["code"] == "unknown_parameter"
    status, body = http(server.url + COMP, {"prompt": "a", "user": "u"})
    assert status == 200 and body["choices"][0]["text"]
    assert_error(*http(server.url + "/v1/nothing-here"), 404)


def test_no_chat_template_and_no_worker(make_server, model: ServedModel) -> None:
    bare = dataclasses.replace(model, chat_template=ChatTemplate(None, model_name="SmolLM2"))
    server = make_server(served=bare)
    err = assert_error(*http(server.url + CHAT, {"messages": MSGS}), 400, "messages")
    assert "chat template" in err["message"]
    # Without a worker, completions are well-formed but cannot be served; the context limit
    # comes from the GGUF metadata until a worker says otherwise.
    assert_error(*http(server.url + COMP, {"prompt": "a"}), 503)
    assert_error(*http(server.url + COMP, {"prompt": "a", "max_tokens": 9000}), 400, "max_tokens")
    assert http(server.url + COMP, {"prompt": "a", "max_tokens": 5000})[0] == 503


# -- auth, tokenize, health, metrics --------------------------------------------------------------


def test_api_keys(make_server, make_worker) -> None:
    server = make_server(api_keys=("k1", "k2"))
    status, body = http(server.url + "/health")
    assert status == 503 and body == {"status": "no workers ready"}  # no key needed
    for key in (None, "wrong"):
        err = assert_error(*http(server.url + "/v1/models", key=key), 401)
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert_error(*http(server.url + "/metrics"), 401)
    assert_error(*http(server.url + "/tokenize", {"content": "a"}), 401)
    assert http(server.url + "/v1/models", key="k2")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    make_worker(server, "w1")
    out = server.client("k1").chat.completions.create(model=NAME, messages=MSGS)
    assert out.choices[0].message.content == REPLY


def test_tokenize_detokenize(served, model: ServedModel) -> None:
    server, _ = served
    tok = model.tokenizer
    text = "<|im_start|>user\nHello, wörld!<|im_end|>"
    status, body = http(server.url + "/tokenize", {"content": text})
    assert status == 200
    assert body["tokens"] == tok.encode(text, add_special=False, special=True)
    assert body["tokens"][0] == tok.token_to_id("<|im_start|>")
    _, body = http(server.url + "/tokenize", {"content": "Hi there", "with_pieces": True})
    assert [p["piece"] for p in body["tokens"]] == ["Hi", " there"]
    assert [p["id"] for p in body["tokens"]] == tok.encode("Hi there", add_special=False)
    _, back = http(server.url + "/detokenize", {"tokens": tok.encode(text, special=True)})
    assert back == {"content": text}
    assert_error(*http(server.url + "/detokenize", {"tokens": [10**8]}), 400, "tokens")
    assert_error(*http(server.url + "/tokenize", {"content": 3}), 400, "content")
