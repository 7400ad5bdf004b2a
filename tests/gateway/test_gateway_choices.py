"""n > 1 over real HTTP and ZMQ against fake workers (tests/gateway_harness.py): n choices
indexed 0..n-1, seeds seed + i, all n sent to one worker, the others after choice 0's first
token (its prompt then in the worker's prefix cache), usage with the prompt counted once,
streams interleaving the choices, and a client that leaves aborting every choice."""

from __future__ import annotations

from collections import defaultdict

import pytest

from services.gateway.choices import choice_seed
from services.gateway.served_model import ServedModel

openai = pytest.importorskip("openai")

from tests.gateway.conftest import chat_prompt_ids  # noqa: E402
from tests.gateway_harness import (  # noqa: E402
    CHAT,
    COMP,
    MSGS,
    NAME,
    REJECTED_MAX_TOKENS,
    REPLY,
    assert_error,
    http,
    open_request,
    read_until,
    wait_until,
)


def test_choice_seeds_stay_in_int64() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
    assert choice_seed(2**63 - 1, 1) == -(2**63) and choice_seed(-1, 1) == 0


def test_n_choices_go_to_one_worker(make_server, make_worker, model, reply_ids) -> None:
    server = make_server()
    workers = [make_worker(server, "w1"), make_worker(server, "w2")]
    wait_until(lambda: http(server.url + "/health")[1].get("workers") == 2, what="two workers")
    out = server.client().completions.create(model=NAME, prompt="Four", n=4, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert {c.text for c in out.choices} == {REPLY}
    assert {c.finish_reason for c in out.choices} == {"stop"}
    prompt_ids = model.tokenizer.encode("Four", add_special=True, special=True)
    assert out.usage.prompt_tokens == len(prompt_ids)  # once, not per choice
    assert out.usage.completion_tokens == 4 * (len(reply_ids) + 1)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert sorted(len(w.generates) for w in workers) == [0, 4]
    gens = [g for w in workers for g in w.generates]
    assert all(list(g.prompt_ids) == prompt_ids for g in gens)
    assert sorted(g.sampling.seed for g in gens) == [7, 8, 9, 10]

    chat = server.client().chat.completions.create(model=NAME, messages=MSGS, n=2)
    assert [(c.index, c.message.content) for c in chat.choices] == [(0, REPLY), (1, REPLY)]
    assert chat.usage.prompt_tokens == len(chat_prompt_ids(model, MSGS))
    assert [g.sampling.seed for w in workers for g in w.generates[-2:]].count(None) >= 2
    for stream in (False, True):  # a choice the worker refuses fails the request
        body = {"prompt": "a", "n": 3, "max_tokens": REJECTED_MAX_TOKENS, "stream": stream}
        assert_error(*http(server.url + COMP, body), 413)


def test_n_choices_stream(served, model: ServedModel, reply_ids: list[int]) -> None:
    server, _ = served
    chunks = list(
        server.client().chat.completions.create(
            model=NAME, messages=MSGS, n=3, stream=True, stream_options={"include_usage": True}
        )
    )
    by_index = defaultdict(list)
    for c in chunks[:-1]:
        assert len(c.choices) == 1 and c.usage is None
        by_index[c.choices[0].index].append(c.choices[0])
    assert sorted(by_index) == [0, 1, 2]
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"  # each choice opens with its role
        assert "".join(c.delta.content or "" for c in choices) == REPLY
        assert [c.finish_reason for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1].finish_reason == "stop"
    usage = chunks[-1].usage  # once, at the end
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(chat_prompt_ids(model, MSGS))
    assert usage.completion_tokens == 3 * (len(reply_ids) + 1)

    stream = server.client().completions.create(
        model=NAME, prompt="Echo: ", n=2, echo=True, stream=True
    )
    texts = defaultdict(str)
    for c in stream:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: "Echo: " + REPLY, 1: "Echo: " + REPLY}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_every_choice(make_server, make_worker, stream: bool) -> None:
    server = make_server()
    worker = make_worker(server, "w1")
    body = {"messages": MSGS, "max_tokens": 1500, "ignore_eos": True, "n": 3, "stream": stream}
    sock = open_request(server, CHAT, body)
    if stream:
        read_until(sock, b"data: ")
    wait_until(lambda: len(worker.generates) == 3, what="three Generates")
    sock.close()
    ids = {g.request_id for g in worker.generates}
    wait_until(lambda: ids <= set(worker.aborts), timeout=1.5, what="three Aborts")


def test_other_choices_start_after_the_first_ones_first_token(make_server, make_worker) -> None:
    server = make_server()
    worker = make_worker(server, "w1")
    out = server.client().completions.create(model=NAME, prompt="a", n=3, max_tokens=4)
    assert len(out.choices) == 3
    first, *others = [worker.steps_before[g.request_id] for g in worker.generates]
    assert len(others) == 2 and all(k > first for k in others), (first, others)
