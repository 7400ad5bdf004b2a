"""The draft-model proposer with real processes: a gateway, a CPU worker and `python -m
services.spec --draft` holding SmolLM2's first layers (written at test time into a tmp dir):
greedy answers are the same as with speculation off, and the draft model's guesses were kept
(the gateway's /metrics, source "draft"). Prose prompts, where prompt lookup finds little and
the draft model answers; a handful only (CI time)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from shared.launch.spec_flag import DRAFT_WAIT_MS
from tests.cluster import Cluster, start_service
from tests.test_spec_e2e import WORKER_ARGS, Spec, _answers, _serve, _spec_metric
from tools.truncate_gguf import truncate_gguf
from tools.w5_workload import prose

LAYERS = 20  # of SmolLM2's 30: its guesses match the target's next token ~1 time in 4 (8: 1 in 20)
PROMPTS = 4


@pytest.fixture(scope="module")
def draft_path(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("draft") / f"smol-{LAYERS}l.gguf"
    return truncate_gguf(smollm2_path, out, LAYERS)


def _start_draft_spec(draft: Path, target: Path) -> Spec:
    spec = Spec()
    spec.proc = start_service(
        "services.spec", "--endpoint", spec.endpoint, "--table-max-ngrams", "0",
        "--draft", str(draft), "--target", str(target), "--draft-threads", "1",
    )  # fmt: skip
    return spec


def _spec_source_metric(c: Cluster, event: str, source: str) -> float:
    _spec_metric(c, event)  # settled: a heartbeat has carried the counts
    with urllib.request.urlopen(f"{c.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("skiff_spec_tokens{")
        and f'event="{event}"' in line
        and f'source="{source}"' in line
    )


def test_greedy_answers_unchanged_with_a_draft_model(smollm2_path: Path, draft_path: Path) -> None:
    prompts = prose(PROMPTS)
    c = _serve(smollm2_path, None)
    try:
        plain = _answers(c, prompts)
    finally:
        c.stop()
    spec = _start_draft_spec(draft_path, smollm2_path)
    # as `skiff serve --spec draft:PATH` starts it: a step waits for the draft's guesses
    args = (*WORKER_ARGS, "--spec", spec.endpoint, "--spec-wait-ms", str(DRAFT_WAIT_MS))
    c = Cluster(smollm2_path, 1, worker_args=args).start()
    try:
        speculated = _answers(c, prompts)
        accepted = _spec_source_metric(c, "accepted", "draft")
        drafted = _spec_source_metric(c, "drafted", "draft")
    finally:
        c.stop()
        spec.stop()
    diff = [i for i, (a, b) in enumerate(zip(plain, speculated, strict=True)) if a != b]
    assert not diff, [(prompts[i][:60], plain[i], speculated[i]) for i in diff[:3]]
    assert drafted > 0 and accepted > 0, (drafted, accepted)
