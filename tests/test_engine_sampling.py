"""Sampling through the engine on the CPU: seeded sampling reproducible whatever the batch, and
logprobs (top-k ids and values) equal to those of the recomputed distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.engine import Sequence
from shared.loader import GGUFFile
from shared.model import load_model
from shared.model.causal_lm import CausalLM
from shared.sampling import SamplingParams, make_generator
from tests.test_engine import (
    GREEDY,
    SPECS,
    full_logits,
    greedy_alone,
    greedy_seq,
    make_engine,
    prompt,
    run_all,
)
from tools.synthetic_gguf import write_synthetic_gguf


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: more threads only spin (see tests/test_engine.py)
    d = tmp_path_factory.mktemp("engine-sampling-llama")
    path = write_synthetic_gguf(d / "llama.gguf", SPECS["llama"])
    yield load_model(GGUFFile(path, cache_dir=d / "cache"), "cpu")
    torch.set_num_threads(threads)


def sampled_run(model: CausalLM, seed: int, others: int = 0) -> list[int]:
    engine = make_engine(model, max_batch_tokens=16)
    seq = Sequence(
        0,
        prompt(12, seed=8),
        SamplingParams(temperature=1.0, seed=seed),
        24,
        generator=make_generator(seed, "cpu"),
    )
    engine.add(seq)
    for i in range(others):  # greedy and unseeded neighbours in the same batches
        params = GREEDY if i % 2 else SamplingParams(temperature=1.0)
        engine.add(Sequence(i + 1, prompt(5 + 3 * i, seed=30 + i), params, 24))
    run_all(engine)
    return seq.output_ids


def test_seeded_sampling_is_reproducible(llama: CausalLM) -> None:
    first = sampled_run(llama, 123)
    assert len(first) == 24
    assert sampled_run(llama, 123) == first
    assert sampled_run(llama, 123, others=3) == first  # batch neighbours do not change it
    assert sampled_run(llama, 124) != first
    assert first != greedy_alone(llama, prompt(12, seed=8), 24)  # it did sample


def test_logprobs(llama: CausalLM) -> None:
    engine = make_engine(llama, max_batch_tokens=20)
    ids3 = prompt(9, seed=40)
    three = Sequence(0, ids3, SamplingParams(temperature=0, logprobs=3), 8)
    one = Sequence(1, prompt(15, seed=41), SamplingParams(temperature=0, logprobs=1), 8)
    none = greedy_seq(2, prompt(4, seed=42), 8)
    for s in (three, one, none):
        engine.add(s)
    events = run_all(engine)
    by_seq = {i: [e for e in events if e.seq_id == i] for i in range(3)}
    assert all(len(v) == 8 for v in by_seq.values())

    for e in by_seq[0]:
        assert e.top is not None and len(e.top) == 3
        ids = [t for t, _ in e.top]
        lps = [lp for _, lp in e.top]
        assert all(isinstance(t, int) for t in ids) and len(set(ids)) == 3
        assert lps == sorted(lps, reverse=True)
        assert all(lp <= 0.0 for lp in lps)
        assert ids[0] == e.token_id  # greedy picks the top token ...
        assert e.logprob == pytest.approx(lps[0], abs=1e-6)  # ... and reports its logprob
    for e in by_seq[1]:
        assert e.top is not None and len(e.top) == 1 and e.top[0][0] == e.token_id
    assert all(e.top is None for e in by_seq[2])

    # the top-3 are those of the recomputed distribution
    logits = full_logits(llama, ids3 + three.output_ids[:-1])[len(ids3) - 1 :]
    ref = torch.log_softmax(logits, -1).topk(3, dim=-1)
    for i, e in enumerate(by_seq[0]):
        assert [t for t, _ in e.top] == ref.indices[i].tolist()
        np.testing.assert_allclose([lp for _, lp in e.top], ref.values[i].numpy(), atol=1e-4)
