"""A pipelined worker with real processes: a gateway and a CPU worker whose model is split over
two stage processes (`--stages cpu`), driven by the openai SDK.

- Streamed greedy answers equal a one-stage worker's, on SmolLM2 and on Gemma 3.
- kill -9 of the stage process while streams run: they end with an error (no hang), the worker
  exits and says why, and the gateway stays up.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.cluster import Cluster

WORKER_ARGS = ("--max-model-len", "1024", "--kv-blocks", "96", "--max-batch-tokens", "64")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    " * 5,
    "Write a short story about a lighthouse keeper. " * 3,
]


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)


def _stream(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, ignore_eos: bool = False
) -> str:
    text = []
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True} if ignore_eos else None,
    ):  # fmt: skip
        text.append(chunk.choices[0].text if chunk.choices else "")
    return "".join(text)


def _answers(c: Cluster, max_tokens: int = 12) -> list[str]:
    client, name = _client(c), c.model.name.removesuffix(".gguf")
    return [_stream(client, name, p, max_tokens) for p in PROMPTS]


def _stage_pids(worker_pid: int) -> list[int]:
    """The worker's children running a pipeline stage."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == worker_pid and b"shared.pipeline.stage" in cmd:
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_streamed_answers_equal_one_stage(which: str, request) -> None:
    model = request.getfixturevalue(f"{which}_path")
    c = Cluster(model, 1, worker_args=WORKER_ARGS).start()
    try:
        want = _answers(c)
    finally:
        c.stop()
    c = Cluster(model, 1, worker_args=(*WORKER_ARGS, "--stages", "cpu")).start()
    try:
        assert len(_stage_pids(c.workers[0].pid)) == 1
        assert _answers(c) == want
    finally:
        c.stop()


def test_a_killed_stage_ends_streams_with_errors(smollm2_path: Path) -> None:
    c = Cluster(smollm2_path, 1, worker_args=(*WORKER_ARGS, "--stages", "cpu")).start()
    try:
        (stage,) = _stage_pids(c.workers[0].pid)
        client, name = _client(c), smollm2_path.name.removesuffix(".gguf")
        out: list[str | Exception] = [""] * 3

        def one(i: int) -> None:
            try:
                # no EOS: every stream is still decoding when the stage dies
                out[i] = _stream(client, name, f"Story {i}: {PROMPTS[2]}", 400, ignore_eos=True)
            except Exception as exc:  # noqa: BLE001 - asserted below
                out[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(4)  # every stream is decoding
        os.kill(stage, signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a stream hung"
        assert all(isinstance(o, openai.APIError) for o in out), out
        assert c.workers[0].wait(timeout=30) == 1  # the worker stopped: its pipeline is gone
        assert c.gateway.poll() is None  # the gateway stays up, and says why it cannot serve
        assert c.health() == (503, {"status": "no workers ready"})
    finally:
        c.stop()
