"""The gateway over real HTTP and real ZMQ, against a scripted fake worker.

The gateway app runs on its own event loop in a background thread; `FakeWorker` (a thread with a
DEALER and a PUSH socket speaking shared/protocol.py) announces itself, heartbeats, and answers
every Generate with the tokens of REPLY, then the EOS stop token (or repeats REPLY until
max_tokens when the request has no stop ids, i.e. ignore_eos). Happy paths go through the
official `openai` SDK; error cases through plain HTTP so status and body are checked exactly.
Needs only the SmolLM2 GGUF's header (tokenizer and chat template), no weights on a device.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.served_model import ServedModel
from shared.tokenizer import ChatTemplate

openai = pytest.importorskip("openai")

REPLY = "Hello world, this is a test"
NAME = "smollm2"
MAX_MODEL_LEN = 2048
KV_USED, KV_FREE, WAITING = 5, 95, 1  # what fake workers report in heartbeats
REJECTED_MAX_TOKENS = 777  # fake workers reject requests asking for this many tokens


from tests.gateway_harness import (  # noqa: E402
    FakeWorker,
    GatewayServer,
    assert_error,
    http,
    open_request,
    read_until,
    sse_events,
    wait_until,
)

# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> ServedModel:
    return ServedModel.load(smollm2_path, NAME)


@pytest.fixture(scope="module")
def reply_ids(model: ServedModel) -> list[int]:
    return model.tokenizer.encode(REPLY, add_special=False)


@pytest.fixture
def make_server(model: ServedModel) -> Iterator[Callable[..., GatewayServer]]:
    made: list[GatewayServer] = []

    def make(**kw: Any) -> GatewayServer:
        made.append(GatewayServer(kw.pop("served", model), **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def make_worker(model: ServedModel, reply_ids: list[int]) -> Iterator[Callable[..., FakeWorker]]:
    made: list[FakeWorker] = []

    def make(server: GatewayServer, worker_id: str, wait: bool = True) -> FakeWorker:
        made.append(FakeWorker(server, worker_id, reply_ids, model.tokenizer.eos_id).start())
        if wait:
            wait_until(lambda: http(server.url + "/health")[0] == 200, what="ready")
        return made[-1]

    yield make
    for w in made:
        w.stop()


@pytest.fixture(scope="module")
def served(model: ServedModel, reply_ids: list[int]) -> Iterator[tuple[GatewayServer, FakeWorker]]:
    """One gateway with one worker, shared by the tests that do not kill workers."""
    server = GatewayServer(model)
    worker = FakeWorker(server, "w1", reply_ids, model.tokenizer.eos_id).start()
    wait_until(lambda: http(server.url + "/health")[0] == 200, what="worker w1 ready")
    yield server, worker
    worker.stop()
    server.close()


def chat_prompt_ids(model: ServedModel, messages: list[dict]) -> list[int]:
    text = model.chat_template.render(messages, add_generation_prompt=True)
    return model.tokenizer.encode(text, add_special=False, special=True)


# -- happy paths through the openai SDK -----------------------------------------------------------


def test_chat_completion(served, model: ServedModel, reply_ids: list[int]) -> None:
    server, worker = served
    messages = [{"role": "user", "content": "Say hello"}]
    out = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=50)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model == NAME
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == REPLY
    assert out.choices[0].finish_reason == "stop"
    prompt_ids = chat_prompt_ids(model, messages)
    # The EOS stop token counts as generated, as in llama.cpp and vLLM.
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(reply_ids) + 1
    assert out.usage.total_tokens == len(prompt_ids) + len(reply_ids) + 1
    gen = worker.generate_for(lambda g: g.prompt_ids == prompt_ids and g.max_tokens == 50)
    assert gen.stop_ids == sorted(model.tokenizer.stop_ids)


def test_chat_stream_with_usage(served, model: ServedModel, reply_ids: list[int]) -> None:
    server, _ = served
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say hello"}]},
    ]
    chunks = list(
        server.client().chat.completions.create(
            model=NAME, messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    as_text = [messages[0], {"role": "user", "content": "Say hello"}]  # parts are joined
    assert chunks[-1].usage.prompt_tokens == len(chat_prompt_ids(model, as_text))
    assert chunks[-1].usage.completion_tokens == len(reply_ids) + 1


def test_completion_stop_string_aborts_worker(served, model: ServedModel) -> None:
    server, worker = served
    out = server.client().completions.create(model=NAME, prompt="Tell me", stop=[", this"])
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == "Hello world"
    assert out.choices[0].finish_reason == "stop"
    prompt_ids = model.tokenizer.encode("Tell me", add_special=True, special=True)
    gen = worker.generate_for(lambda g: g.prompt_ids == prompt_ids)
    assert gen.max_tokens == 16  # the completions default
    # The worker still had tokens to send: the gateway must tell it to stop.
    wait_until(lambda: gen.request_id in worker.aborts, what="Abort after the stop string")
    assert out.usage.completion_tokens == 4  # "Hello", " world", ",", " this"


def test_completion_stream_stop_string_across_tokens(served) -> None:
    server, _ = served
    stream = server.client().completions.create(
        model=NAME, prompt="Tell me", stop=["is a t"], stream=True
    )
    chunks = [c.choices[0] for c in stream]
    # " is", " a", " test": the stop string spans three tokens; no part of it may leak out.
    assert "".join(c.text for c in chunks) == "Hello world, this "
    assert chunks[-1].finish_reason == "stop"


def test_completion_length_and_token_prompt(served, model: ServedModel, reply_ids) -> None:
    server, worker = served
    ids = model.tokenizer.encode("Once upon a time")
    out = server.client().completions.create(model=NAME, prompt=ids, max_tokens=3, seed=7)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text == model.tokenizer.decode(reply_ids[:3])
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3
    gen = worker.generate_for(lambda g: g.prompt_ids == ids)
    assert gen.sampling.seed == 7 and gen.max_tokens == 3


def test_echo_and_worker_rejection(served) -> None:
    server, _ = served
    out = server.client().completions.create(model=NAME, prompt="Echo: ", echo=True)
    assert out.choices[0].text == "Echo: " + REPLY
    for stream in (False, True):
        body = {"prompt": "a", "max_tokens": REJECTED_MAX_TOKENS, "stream": stream}
        err = assert_error(*http(server.url + COMP, body), 413)
        assert err["message"] == "prompt too long for my KV pool"


def test_completion_logprobs(served, reply_ids: list[int]) -> None:
    server, worker = served
    out = server.client().completions.create(model=NAME, prompt="Logprobs", logprobs=2)
    lp = out.choices[0].logprobs
    # One entry per counted token: the stop token has one, though its text is not shown.
    n = len(reply_ids) + 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert out.usage.completion_tokens == n
    assert "".join(lp.tokens) == REPLY + "<|im_end|>" and out.choices[0].text == REPLY
    assert lp.token_logprobs == [-0.25] * n
    assert all(1 <= len(d) <= 3 for d in lp.top_logprobs)  # top 2 plus the chosen token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-2:] == [len(REPLY) - len(lp.tokens[-2]), len(REPLY)]
    assert worker.generate_for(lambda g: g.sampling.logprobs == 2)


def test_chat_logprobs(served, reply_ids: list[int]) -> None:
    server, _ = served
    out = server.client().chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == len(reply_ids) + 1 == out.usage.completion_tokens
    assert "".join(e.token for e in content) == REPLY + "<|im_end|>"
    for e in content:
        assert e.logprob == -0.25
        assert bytes(e.bytes).decode() == e.token
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == -0.25 and e.top_logprobs[1].logprob == -1.25


def test_models(served) -> None:
    server, _ = served
    models = server.client().models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].owned_by == "skiff"
    status, body = http(server.url + "/v1/models")
    assert status == 200 and body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http(server.url + f"/v1/models/{NAME}")[1]["id"] == NAME
    assert_error(*http(server.url + "/v1/models/gpt-4"), 404)


# -- errors ---------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

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
    (COMP, {"prompt": "a", "n": 2}, 400, "n"),
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
    (CHAT, {"messages": MSGS, "n": 3}, 400, "n"),
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
    # Unknown fields are ignored; `model` may be omitted.
    status, body = http(server.url + COMP, {"prompt": "a", "frobnicate": 1, "user": "u"})
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


def test_health_follows_workers(make_server, make_worker) -> None:
    server = make_server()
    assert http(server.url + "/health") == (503, {"status": "no workers ready"})
    make_worker(server, "w1")
    assert http(server.url + "/health") == (200, {"status": "ok", "workers": 1})


def metric_samples(server: GatewayServer) -> dict[tuple[str, tuple], float]:
    status, text = http(server.url + "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics(served, reply_ids: list[int]) -> None:
    server, _ = served
    before = metric_samples(server)
    client = server.client()
    client.chat.completions.create(model=NAME, messages=MSGS)
    client.completions.create(model=NAME, prompt="abc", max_tokens=3)
    http(server.url + COMP, {"prompt": "a", "n": 2})
    after = metric_samples(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    ok = {"status": "200"}
    assert delta("skiff_requests_total", endpoint="/v1/chat/completions", **ok) == 1
    assert delta("skiff_requests_total", endpoint="/v1/completions", **ok) == 1
    assert delta("skiff_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("skiff_generation_tokens_total") == len(reply_ids) + 1 + 3
    assert delta("skiff_prompt_tokens_total") >= 2
    assert delta("skiff_time_to_first_token_seconds_count") == 2
    assert delta("skiff_inter_token_latency_seconds_count") == len(reply_ids) + 2
    assert 0 < after[("skiff_time_to_first_token_seconds_sum", ())] < 10
    assert after[("skiff_workers_ready", ())] == 1
    assert after[("skiff_queue_depth", ())] == WAITING
    assert after[("skiff_kv_blocks_used", (("worker", "w1"),))] == KV_USED
    assert after[("skiff_kv_blocks_free", (("worker", "w1"),))] == KV_FREE


# -- cancellation, dead workers, more workers -----------------------------------------------------

LONG = {"prompt": "forever", "max_tokens": 1500, "ignore_eos": True}


@pytest.mark.parametrize("cancellation", [False, True], ids=["polling", "handler-cancel"])
def test_client_disconnect_aborts(make_server, make_worker, cancellation: bool) -> None:
    server = make_server(handler_cancellation=cancellation)
    worker = make_worker(server, "w1")
    for i, stream in enumerate((True, False)):
        sock = open_request(server, COMP, {**LONG, "stream": stream})
        if stream:
            read_until(sock, b"data: ")  # streaming has begun
        wait_until(lambda n=i + 1: len(worker.generates) == n, what="the Generate")
        gen = worker.generates[i]
        assert gen.stop_ids == []  # ignore_eos
        sock.close()
        aborted = lambda g=gen: g.request_id in worker.aborts  # noqa: E731
        wait_until(aborted, timeout=1.5, what=f"Abort (stream={stream})")


def test_dead_worker_fails_requests_and_new_workers_are_used(make_server, make_worker) -> None:
    server = make_server(handler_cancellation=True, heartbeat_timeout_s=0.5)
    w1 = make_worker(server, "w1")
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda: results.update(whole=http(server.url + COMP, LONG))),
        threading.Thread(
            target=lambda: results.update(
                stream=sse_events(server.url + COMP, {**LONG, "stream": True})
            )
        ),
    ]
    for t in threads:
        t.start()
    wait_until(lambda: len(w1.generates) == 2, what="both requests at w1")
    w1.silent.set()
    for t in threads:
        t.join(5)
    err = assert_error(*results["whole"], 503)
    assert "w1" in err["message"] and "heartbeat" in err["message"]
    events = results["stream"]
    assert "error" in events[-1] and "w1" in events[-1]["error"]["message"]
    assert "[DONE]" not in events and events[0]["choices"][0]["text"]
    assert http(server.url + "/health")[0] == 503
    assert_error(*http(server.url + COMP, {"prompt": "a"}), 503)

    # A worker that appears later is taken without restarting the gateway...
    w2 = make_worker(server, "w2")
    assert http(server.url + COMP, {"prompt": "again"})[1]["choices"][0]["text"]
    assert len(w2.generates) == 1
    # ...and so is a worker restarted under the same id (a new DEALER with the old identity).
    w2.stop()
    w2b = make_worker(server, "w2", wait=False)
    body = wait_until(
        lambda: (r := http(server.url + COMP, {"prompt": "third"}))[0] == 200 and r[1],
        what="request served by the restarted w2",
    )
    assert body["choices"][0]["text"] and len(w2b.generates) >= 1


def test_least_loaded_worker_is_chosen(make_server, make_worker) -> None:
    server = make_server()
    workers = [make_worker(server, "w1"), make_worker(server, "w2")]
    wait_until(lambda: http(server.url + "/health")[1].get("workers") == 2, what="two workers")
    socks = []
    for _ in range(4):
        socks.append(open_request(server, COMP, {**LONG, "stream": True}))
        read_until(socks[-1], b"data: ")
    assert [len(w.generates) for w in workers] == [2, 2]
    for s in socks:
        s.close()
    wait_until(lambda: sum(len(w.aborts) for w in workers) == 4, what="four aborts")


def test_gateway_imports_no_runtime() -> None:
    """The wall of STYLE.md: the gateway never pulls in torch, triton or model code."""
    code = (
        "import sys, services.gateway.app, services.gateway.__main__\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')\n"
        "       or m.startswith(('shared.model', 'shared.engine', 'shared.ops'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
