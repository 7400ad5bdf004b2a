"""The worker's spec client against a ROUTER the test plays the spec service on: tokens go up
once per sequence, drafts for the current length become Sequence.draft, late ones from where
the sequence stands if their guesses came true, stale ones not at all, an
unknown sequence is sent whole again, and a missing or silent service costs no waiting."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from shared.engine import Sequence
from shared.engine.draft_length import DraftLength
from shared.protocol import SpecAsk, SpecDraft, SpecDrafts, WorkerToSpec, decoder, encoder
from shared.sampling import SamplingParams
from shared.worker import spec_client
from shared.worker.spec_client import SpecClient


@pytest.fixture
def router():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield ctx, sock, f"tcp://127.0.0.1:{port}"
    ctx.destroy(linger=0)  # the clients' sockets too, when a test failed before closing them


def _seq(seq_id: int, prompt: list[int], out: list[int]) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingParams(temperature=0), 64, spec=DraftLength(4))
    seq.output_ids = list(out)
    return seq


def _recv(sock: zmq.Socket) -> tuple[bytes, SpecAsk]:
    assert sock.poll(2000), "no ask came"
    who, frame = sock.recv_multipart()
    return who, decoder(WorkerToSpec).decode(frame)


def _client(ctx, endpoint, wait_s: float = 0.0) -> tuple[SpecClient, list[str]]:
    logs: list[str] = []
    client = SpecClient(ctx, endpoint, "w0", logs.append, wait_s)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:  # IMMEDIATE: sends fail until the TCP link is up
        client.ask([])
        if client.sock.poll(10, zmq.POLLOUT):
            break
    return client, logs


def test_tokens_go_up_once_and_current_drafts_are_taken(router) -> None:
    ctx, sock, endpoint = router
    client, _ = _client(ctx, endpoint)
    a, b = _seq(1, [5, 6, 7], [8]), _seq(2, [9, 9], [3])
    fresh = _seq(3, [4, 4, 4], [])
    client.introduce(fresh)  # a prompt goes up on arrival, nothing asked of it
    who, ask = _recv(sock)
    assert [(s.seq_id, s.start, s.tokens, s.k) for s in ask.seqs] == [(3, 0, [4, 4, 4], 0)]
    sock.send_multipart([who, encoder().encode(SpecDrafts([]))])
    deadline = time.monotonic() + 2
    while client._out and time.monotonic() < deadline:  # its (empty) answer taken
        client.collect({}, last_step_s=0.05)
    assert not client._out
    client.ask([a, b])
    who, ask = _recv(sock)
    assert [(s.seq_id, s.start, s.tokens, s.k) for s in ask.seqs] == [
        (1, 0, [5, 6, 7, 8], 4), (2, 0, [9, 9, 3], 4),
    ]  # fmt: skip
    drafts = [SpecDraft(1, 4, [1, 2, 3, 4, 5, 6]), SpecDraft(2, 2, [7])]  # b's is stale
    sock.send_multipart([who, encoder().encode(SpecDrafts(drafts))])
    assert client.sock.poll(2000)
    client.collect({1: a, 2: b}, last_step_s=0.05)
    assert a.draft == [1, 2, 3, 4] and a.draft_source == "prompt"  # cut to its k
    assert b.draft == [] and client.stats["stale"] == 1
    a.output_ids.append(11)
    client.ask([a])
    _, ask = _recv(sock)
    assert [(s.seq_id, s.start, s.tokens) for s in ask.seqs] == [(1, 4, [11])]
    # an unknown sequence (a new service) goes up whole next time
    sock.send_multipart([who, encoder().encode(SpecDrafts([], unknown=[1]))])
    client.collect({1: a}, last_step_s=0.05)
    a.output_ids.append(12)
    client.ask([a])
    _, ask = _recv(sock)
    assert (ask.seqs[0].start, ask.seqs[0].tokens) == (0, [5, 6, 7, 8, 11, 12])
    client.close()


def test_a_late_draft_is_taken_from_where_its_guesses_came_true(router) -> None:
    ctx, sock, endpoint = router
    client, _ = _client(ctx, endpoint)
    a, b, c = _seq(1, [5, 6], [7, 8, 9]), _seq(2, [5, 6], [7, 8, 9]), _seq(3, [5], [6])
    client.ask([a, b, c])
    who, _ = _recv(sock)
    # made at lengths 3 and 3 (two tokens ago) and 2 (one ago): a's guesses 8, 9 came true, b's
    # 8, 1 did not, c's draft ran out at the token it guessed
    drafts = [SpecDraft(1, 3, [8, 9, 10, 11]), SpecDraft(2, 3, [8, 1, 10]), SpecDraft(3, 1, [6])]
    sock.send_multipart([who, encoder().encode(SpecDrafts(drafts))])
    assert client.sock.poll(2000)
    client.collect({1: a, 2: b, 3: c}, last_step_s=0.05)
    assert a.draft == [10, 11] and client.stats["caught_up"] == 1
    assert b.draft == [] and c.draft == [] and client.stats["stale"] == 2
    client.close()


def test_paused_and_in_flight_sequences_are_not_asked_about(router) -> None:
    ctx, sock, endpoint = router
    client, _ = _client(ctx, endpoint)
    paused, flying = _seq(1, [1, 2], [3]), _seq(2, [1, 2], [3])
    paused.spec._pause = 3
    flying.num_inflight = 1
    client.ask([paused, flying])
    assert not sock.poll(100) and client.stats["asks"] == 0
    client.close()


def test_a_silent_or_missing_service_costs_no_waiting(router, monkeypatch) -> None:
    ctx, sock, endpoint = router
    client, logs = _client(ctx, endpoint)
    seq = _seq(1, [1, 2], [3])
    client.ask([seq])
    _recv(sock)  # asked, never answered
    t = time.perf_counter()
    client.collect({1: seq}, last_step_s=1.0)
    assert time.perf_counter() - t < 0.05 and client.stats["late"] == 1  # one grace, short
    monkeypatch.setattr(spec_client, "DEAD_AFTER_S", 0.0)
    seq.output_ids.append(4)
    client.ask([seq])  # the first ask is over the limit: the service is taken for gone
    assert not client.up and any("without proposals" in m for m in logs)
    t = time.perf_counter()
    for _ in range(20):
        client.collect({1: seq}, last_step_s=1.0)
    assert time.perf_counter() - t < 0.01
    # nothing listens at all: the sends fail at once
    lone, logs = SpecClient(ctx, "tcp://127.0.0.1:9", "w1", [].append), []
    lone.ask([seq])
    assert not lone.up and lone.stats["dropped_sends"] == 1
    lone.close()
    client.close()


def test_with_a_set_wait_every_answer_out_is_waited_for_up_to_it(router) -> None:
    """A draft model's guesses take forwards: the worker set to wait takes an answer that comes
    80 ms after the ask's (which the default grace would find late), behind an earlier one."""
    ctx, sock, endpoint = router
    client, _ = _client(ctx, endpoint, wait_s=0.5)
    seq = _seq(1, [5, 6], [7])
    client.introduce(_seq(2, [1], []))
    client.ask([seq])
    who, _ = _recv(sock)
    _recv(sock)
    sock.send_multipart([who, encoder().encode(SpecDrafts([]))])  # the introduction's: at once

    def answer_later() -> None:
        time.sleep(0.08)
        sock.send_multipart([who, encoder().encode(SpecDrafts([SpecDraft(1, 3, [8, 9], "draft")]))])

    t0 = time.perf_counter()
    later = threading.Thread(target=answer_later)
    later.start()
    client.collect({1: seq}, last_step_s=0.02)
    waited = time.perf_counter() - t0
    later.join()
    assert seq.draft == [8, 9] and seq.draft_source == "draft" and not client._out
    assert 0.07 < waited < 0.45, waited  # as long as the answer took, not the whole wait
    client.close()
