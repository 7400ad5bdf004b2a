"""Fixtures of the gateway tests: the served model (SmolLM2's header), gateways and
fake workers made per test or per module (tests/gateway_harness.py has the machinery)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.gateway.served_model import ServedModel
from tests.gateway_harness import NAME, REPLY, FakeWorker, GatewayServer, http, wait_until


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
