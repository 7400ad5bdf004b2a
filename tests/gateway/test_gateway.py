"""The gateway over real HTTP and real ZMQ, against a scripted fake worker.

The gateway app runs on its own event loop in a background thread; `FakeWorker` (a thread with a
DEALER and a PUSH socket speaking shared/protocol.py) announces itself, heartbeats, and answers
every Generate with the tokens of REPLY, then the EOS stop token (or repeats REPLY until
max_tokens when the request has no stop ids, i.e. ignore_eos). Happy paths go through the
official `openai` SDK (error cases: test_gateway_errors.py, through plain HTTP).
Needs only the SmolLM2 GGUF's header (tokenizer and chat template), no weights on a device.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.served_model import ServedModel

openai = pytest.importorskip("openai")

from tests.gateway.conftest import chat_prompt_ids  # noqa: E402
from tests.gateway_harness import (  # noqa: E402
    COMP,
    GRAMMAR,
    KV_FREE,
    KV_USED,
    MAX_MODEL_LEN,
    MSGS,
    NAME,
    REJECTED_MAX_TOKENS,
    REPLY,
    WAITING,
    GatewayServer,
    assert_error,
    http,
    open_request,
    read_until,
    sse_events,
    wait_until,
)

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


def test_echo_and_worker_rejection(served, model: ServedModel) -> None:
    server, _ = served
    out = server.client().completions.create(model=NAME, prompt="Echo: ", echo=True)
    assert out.choices[0].text == "Echo: " + REPLY
    ids = model.tokenizer.encode("Echo these ids: ", add_special=False)
    out = server.client().completions.create(model=NAME, prompt=ids, echo=True)
    assert out.choices[0].text == model.tokenizer.decode(ids) + REPLY  # ids are decoded to echo
    for stream in (False, True):
        body = {"prompt": "a", "max_tokens": REJECTED_MAX_TOKENS, "stream": stream}
        err = assert_error(*http(server.url + COMP, body), 413)
        assert err["message"] == "prompt too long for my KV pool"


def test_long_text_prompt_reaches_the_worker_as_its_ids(served, model: ServedModel) -> None:
    server, worker = served
    text = "Pages of cached keys. " * 400
    server.client().completions.create(model=NAME, prompt=text, max_tokens=2)
    want = model.tokenizer.encode(text, add_special=True, special=True)
    assert len(want) < MAX_MODEL_LEN
    assert list(worker.generate_for(lambda g: len(g.prompt_ids) == len(want)).prompt_ids) == want


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
    http(server.url + COMP, {"prompt": "a", "n": 17})
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
    for event, n in GRAMMAR.items():
        assert after[("skiff_grammar", (("event", event), ("worker", "w1")))] == n


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


def test_domain_reaches_the_worker_from_the_body_or_the_api_key(make_server, make_worker) -> None:
    server = make_server(api_keys=("k1", "k2"), key_domains={"k1": "sql"})
    worker = make_worker(server, "w1")
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    cases = [("k1", {}, "sql"), ("k1", {"domain": "code"}, "code"), ("k2", {}, "")]
    for key, extra, want in cases:
        status, out = http(server.url + COMP, {**body, **extra}, key=key)
        assert status == 200, out
        assert worker.generates[-1].domain == want, (key, extra)
    for bad in ("", "-x", "a b", 7, "x" * 65):
        assert_error(*http(server.url + COMP, {**body, "domain": bad}, key="k2"), 400, "domain")
