"""Speculation with real processes: a gateway, a CPU worker and `python -m services.spec`.
Greedy prompts (code edits from standard-library sources, and prose) answer the same text with
speculation on as off on SmolLM2 and on Gemma 3, and the drafts were used (the gateway's
/metrics): 8 prompts on SmolLM2 and 4 on Gemma 3 in CI, 50 per model with `pytest -m long`; the
spec service killed while requests run: none fails, each answers the same, and the worker uses
the service again once it is back."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, http_json, start_service
from tools.w5_workload import code_edits, prose

MAX_TOKENS = 32
WORKER_ARGS = ("--max-model-len", "2048", "--spec-max-tokens", "8")


class Spec:
    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Spec:
        self.proc = start_service(
            "services.spec", "--endpoint", self.endpoint, "--table-max-ngrams", "0"
        )
        return self

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


def _chat(c: Cluster, text: str) -> str:
    """Completions (Gemma 3 270m's file has no chat template), the task then its answer."""
    body = {
        "model": c.model.name.removesuffix(".gguf"),
        "prompt": f"{text}\n\nAnswer:\n",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    status, out = http_json(f"{c.url}/v1/completions", body, timeout=300)
    assert status == 200, out
    return out["choices"][0]["text"]


def _answers(c: Cluster, prompts: list[str]) -> list[str]:
    """One request at a time: concurrent prompts share steps in an order that depends on
    timing, and how a prompt's prefill is cut into chunks changes its logits in the last bits
    with speculation off as on; a request alone runs the same steps both times."""
    return [_chat(c, p) for p in prompts]


def _spec_metric(c: Cluster, event: str) -> float:
    """The count once heartbeats carry it: the same in two reads a heartbeat apart (the last
    one may not have come when the answers did)."""
    last = None
    for _ in range(10):
        time.sleep(0.6)
        with urllib.request.urlopen(f"{c.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        now = sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("skiff_spec_tokens{") and f'event="{event}"' in line
        )
        if now == last:
            return now
        last = now
    return last


def _serve(model: Path, spec: Spec | None) -> Cluster:
    args = (*WORKER_ARGS, *(("--spec", spec.endpoint) if spec else ()))
    return Cluster(model, 1, worker_args=args).start()


# Code edits of functions of at most 20 lines, and prose: half and half. The full size, 50 per
# model, takes ~40 minutes of two cores (each prompt served twice); CI's 8 + 4 ~4 (Gemma 3's
# 262k-token vocabulary makes its steps the slower).
SIZES = {("smollm2", "ci"): 4, ("gemma3", "ci"): 2, ("smollm2", "full"): 25, ("gemma3", "full"): 25}


def _prompts(half: int) -> list[str]:
    return code_edits(half, max_lines=20) + prose(half)


@pytest.mark.parametrize("size", ["ci", pytest.param("full", marks=pytest.mark.long)])
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_greedy_answers_unchanged_and_drafts_used(which: str, size: str, request) -> None:
    model = request.getfixturevalue(f"{which}_path")
    half = SIZES[which, size]
    prompts = _prompts(half)
    c = _serve(model, None)
    try:
        plain = _answers(c, prompts)
    finally:
        c.stop()
    spec = Spec().start()
    c = _serve(model, spec)
    try:
        speculated = _answers(c, prompts)
        accepted = _spec_metric(c, "accepted")
    finally:
        c.stop()
        spec.stop()
    diff = [i for i, (a, b) in enumerate(zip(plain, speculated, strict=True)) if a != b]
    assert not diff, [(prompts[i][:60], plain[i], speculated[i]) for i in diff[:3]]
    # the code edits copy their prompts: drafts held, about two tokens a prompt at the least
    assert accepted > 2 * half, accepted


def test_spec_service_killed_mid_run(smollm2_path: Path) -> None:
    prompts = code_edits(12, max_lines=20)  # short: CI time (40 lines took ~300 s of a core)
    c = _serve(smollm2_path, None)
    try:
        want = _answers(c, prompts)
    finally:
        c.stop()
    spec = Spec().start()
    c = _serve(smollm2_path, spec)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_answers, c, prompts[:8])
            time.sleep(3)
            spec.stop(signal.SIGKILL)
            got = running.result()
        assert got == want[:8]  # none failed, none changed
        before = _spec_metric(c, "accepted")
        spec = Spec.__new__(Spec)  # the same endpoint, a new process
        spec.endpoint, spec.proc = c.worker_args[-1], None
        spec.start()
        time.sleep(1.5)  # the worker asks again once a second
        # prompts this worker has not seen (a repeated one would start from the prefix cache,
        # whose chunking changes the last bits of its logits)
        assert _answers(c, prompts[8:]) == want[8:]
        assert _spec_metric(c, "accepted") > before
    finally:
        c.stop()
        spec.stop()
