"""Prefill and decode as separate workers, with real processes: a gateway, the kvcache, one
`services.prefill` and two `services.decode` workers serving SmolLM2 on the CPU, driven by the
openai SDK.

- Greedy answers, streamed and not, are those of one combined worker, token for token (the
  streamed text is the whole text: the first token, from the prefill worker, neither repeated
  nor lost at the hand-over), and every request was handed on (the gateway's /metrics).
- Requests with random cancels (40 in CI, 300 with `pytest -m long`) leave every worker's KV
  pool empty and the kvcache with no slot pinned.
- kill -9 of a decode worker: its streams end with an error, the others finish; of the prefill
  worker mid-prompt: its requests move to the decode workers and finish; of the kvcache: the
  decode workers compute what they cannot restore, no request fails.
"""

from __future__ import annotations

import random
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.cluster import Cluster, free_port, start_service
from tools.w5_workload import code_edits, prose

WORKER_ARGS = ("--max-model-len", "2048", "--max-batch-tokens", "512")
MAX_TOKENS = 20


def _prompts() -> list[str]:
    """Varied lengths: under a block, a few blocks, a few hundred tokens, and over 512 (two
    chunks), as tasks and their answer to come."""
    code = code_edits(6, max_lines=120)
    tasks = [prose(1)[0], code[0], code[1], code[3] + "\n" + code[4]]
    return ["The capital of France is", "def fibonacci(n):"] + [f"{t}\n\nAnswer:\n" for t in tasks]


class KVCache:
    def __init__(self, tmp: Path) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        self.tmp = tmp
        self.proc = None

    def start(self) -> KVCache:
        (self.tmp / "disk").mkdir(exist_ok=True)
        (self.tmp / "shm").mkdir(exist_ok=True)
        self.proc = start_service(
            "services.kvcache", "--endpoint", self.endpoint, "--ram-gb", "0.25",
            "--disk-gb", "0", "--shm-dir", str(self.tmp / "shm"),
            "--metrics-port", str(self.metrics_port), "--worker-timeout", "10",
        )  # fmt: skip
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)

    def metric(self, name: str, label: str = "") -> float:
        return _metric(f"http://127.0.0.1:{self.metrics_port}/metrics", name, label)


def _metric(url: str, name: str, label: str = "") -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and label in line and not line.startswith("#")
    )


class Split:
    """A gateway, the kvcache, a prefill worker and two decode workers."""

    def __init__(self, model: Path, tmp: Path) -> None:
        self.kv = KVCache(tmp).start()
        self.c = Cluster(model, 0, worker_args=(*WORKER_ARGS, "--kvcache", self.kv.endpoint))
        self.c.start()
        self.prefill = self.c.start_worker("services.prefill")
        self.decode = [self.c.start_worker(), self.c.start_worker()]
        self.c.wait_workers(3)
        self.client = openai.OpenAI(base_url=f"{self.c.url}/v1", api_key="none", max_retries=0)
        self.name = model.name.removesuffix(".gguf")

    def metric(self, name: str, label: str = "") -> float:
        time.sleep(0.6)  # a heartbeat carries the workers' counts
        return _metric(f"{self.c.url}/metrics", name, label)

    def stop(self) -> None:
        self.c.stop()
        self.kv.stop()


def _complete(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> tuple[str, int]:
    """(text, completion tokens), greedy; streamed: the chunks' text joined, and the count of
    the chunks that carried a token."""
    kw = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        out = client.completions.create(**kw)
        return out.choices[0].text, out.usage.completion_tokens
    text, usage = [], None
    for chunk in client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), usage.completion_tokens


@pytest.fixture(scope="module")
def combined(smollm2_path: Path) -> list[tuple[str, int]]:
    """The combined worker's answers, one request at a time."""
    c = Cluster(smollm2_path, 1, worker_args=WORKER_ARGS).start()
    try:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)
        name = smollm2_path.name.removesuffix(".gguf")
        return [_complete(client, name, p, False) for p in _prompts()]
    finally:
        c.stop()


@pytest.fixture(scope="module")
def split(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Split:
    """One set of processes for the module: the fault tests run last and restart the roles
    they kill (the kvcache's, the last, is not needed after it)."""
    s = Split(smollm2_path, tmp_path_factory.mktemp("split"))
    yield s
    s.stop()


@pytest.mark.parametrize("requests", [40, pytest.param(300, marks=pytest.mark.long)])
def test_answers_match_the_combined_worker_and_cancels_leave_it_clean(
    split: Split, combined, requests: int
) -> None:
    _greedy_answers_match(split, combined)
    _cancels_leave_pools_and_tiers_clean(split, requests)


def test_faults_of_each_role(split: Split) -> None:
    _decode_worker_killed_fails_only_its_streams(split)
    _prefill_worker_killed_mid_prompt_requests_move_on(split)
    _kvcache_killed_no_request_fails(split)


def _greedy_answers_match(split: Split, combined) -> None:
    got = [
        _complete(split.client, split.name, p, stream=i % 2 == 1) for i, p in enumerate(_prompts())
    ]
    assert got == combined
    assert split.metric("skiff_request_moves", 'event="handed_on"') >= len(got)
    # the decode workers restored the prompts' blocks (partial ones included)
    assert split.metric("skiff_kv_tier_events", 'event="restored"') >= len(got)


def _cancels_leave_pools_and_tiers_clean(split: Split, requests: int) -> None:
    rng = random.Random(7)
    texts = code_edits(10) + prose(10)
    prompts = [f"Item {i}: " + t[: rng.randrange(20, 600)] for i, t in enumerate(texts)]
    failures: list[str] = []

    def one(i: int) -> None:
        r = random.Random(i)
        kw = dict(model=split.name, prompt=r.choice(prompts), max_tokens=r.randrange(2, 12))
        try:
            if r.random() < 0.4:  # cancelled: the stream closed after a token or two
                stream = split.client.completions.create(**kw, stream=True)
                for n, _ in enumerate(stream):
                    if n >= r.randrange(0, 3):
                        break
                stream.close()
            else:
                out = split.client.completions.create(**kw)
                assert out.usage.completion_tokens >= 1
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            failures.append(f"{i}: {exc!r}")

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(requests)))
    assert not failures, failures[:5]
    time.sleep(1.0)  # the last aborts reach the workers
    assert split.metric("skiff_kv_blocks_used") == 0
    assert split.kv.metric("skiff_kvcache_slots", 'state="pinned"') == 0


def _streams(
    split: Split, prompts: list[str], max_tokens: int
) -> tuple[list[str | Exception], list[threading.Thread]]:
    """Streams the prompts concurrently; each one's text, or the exception that ended it."""
    out: list[str | Exception] = [""] * len(prompts)

    def one(i: int) -> None:
        try:
            kw = dict(model=split.name, prompt=prompts[i], max_tokens=max_tokens, temperature=0)
            for chunk in split.client.completions.create(**kw, stream=True):
                out[i] += chunk.choices[0].text if chunk.choices else ""
        except Exception as exc:  # noqa: BLE001 - returned
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return out, threads


def _decode_worker_killed_fails_only_its_streams(split: Split) -> None:
    prompts = [f"Story {i}: {p}\n\nAnswer:\n" for i, p in enumerate(prose(8))]
    out, threads = _streams(split, prompts, 96)
    time.sleep(6)  # every stream is decoding
    victim = split.decode.pop(0)
    victim.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    failed = [o for o in out if isinstance(o, Exception)]
    assert failed and len(failed) < len(out), out
    assert all(isinstance(o, openai.APIError) for o in failed), failed
    split.decode.append(split.c.start_worker())  # for the next tests
    split.c.wait_workers(3)


def _prefill_worker_killed_mid_prompt_requests_move_on(split: Split) -> None:
    long = "\n".join(code_edits(12))[:5000]  # ~1,400 tokens each: seconds of prefill apiece
    prompts = [f"Version {i}. {long}" for i in range(4)]
    moved = split.metric("skiff_request_moves", 'event="prefill_lost"')
    with ThreadPoolExecutor(4) as pool:
        running = [
            pool.submit(split.client.completions.create, model=split.name, prompt=p, max_tokens=8)
            for p in prompts
        ]
        time.sleep(2.0)
        split.prefill.send_signal(signal.SIGKILL)
        outs = [r.result(timeout=300) for r in running]
    assert all(o.usage.completion_tokens >= 1 for o in outs)
    assert split.metric("skiff_request_moves", 'event="prefill_lost"') > moved
    split.prefill = split.c.start_worker("services.prefill")
    split.c.wait_workers(3)


def _kvcache_killed_no_request_fails(split: Split) -> None:
    prompts = [f"Note {i}: {p}" for i, p in enumerate(code_edits(6))]
    with ThreadPoolExecutor(6) as pool:
        running = [
            pool.submit(split.client.completions.create, model=split.name, prompt=p, max_tokens=8)
            for p in prompts
        ]
        time.sleep(1.0)
        split.kv.stop(signal.SIGKILL)
        outs = [r.result(timeout=300) for r in running]
    assert all(o.usage.completion_tokens >= 1 for o in outs)
    # and without a kvcache at all, prompts are still handed on (decoded from scratch)
    out = split.client.completions.create(model=split.name, prompt=prompts[0], max_tokens=4)
    assert out.usage.completion_tokens >= 1
