"""Overlapped steps (the CPU schedules and launches step N+1 before step N's ids reach the host)
generate exactly what synchronous steps generate: greedy and seeded sampling, stop ids and
max_tokens, penalties (which fall back to synchronous steps), chunked prefill, preemption and
aborts; every block comes back and the block manager stays consistent."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLMEngine, SeqStatus, Sequence, TokenEvent
from shared.engine.model_runner import ModelRunner
from shared.kv import BlockManager, KVPool
from shared.loader import GGUFFile
from shared.model import load_model
from shared.model.causal_lm import CausalLM
from shared.sampling import SamplingParams, make_generator
from tests.test_engine import SPECS, prompt
from tools.synthetic_gguf import write_synthetic_gguf


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("overlap-llama")
    path = write_synthetic_gguf(d / "llama.gguf", SPECS["llama"])
    yield load_model(GGUFFile(path, cache_dir=d / "cache"), "cpu")
    torch.set_num_threads(threads)


def engine(model: CausalLM, overlap: bool, num_blocks: int = 64, budget: int = 24) -> LLMEngine:
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, num_blocks, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
    return LLMEngine(
        ModelRunner(model, kv, "cpu"), BlockManager(num_blocks, 4), 128, budget, overlap=overlap
    )


def requests(kinds: str, stop_after: dict[int, int] | None = None) -> list[Sequence]:
    """Six requests of different lengths; kinds: greedy, seeded, penalties or mixed."""
    seqs = []
    for i, (n, max_tokens) in enumerate(((5, 9), (17, 4), (9, 14), (30, 6), (3, 1), (12, 11))):
        kind = kinds if kinds != "mixed" else ("greedy", "seeded", "penalties")[i % 3]
        params = {
            "greedy": SamplingParams(temperature=0, logprobs=2),
            "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i),
            "penalties": SamplingParams(temperature=0, repetition_penalty=1.3),
        }[kind].validate()
        gen = make_generator(params.seed, "cpu")
        stops = frozenset({stop_after[i]}) if stop_after and i in stop_after else frozenset()
        seqs.append(Sequence(i, prompt(n, seed=i), params, max_tokens, stops, gen))
    return seqs


def run(eng: LLMEngine, seqs: list[Sequence], abort: dict[int, int] | None = None) -> dict:
    for s in seqs:
        eng.add(s)
    events: list[TokenEvent] = []
    steps = 0
    while eng.has_work():
        events += eng.step()
        steps += 1
        for seq_id, at in (abort or {}).items():
            if steps == at:
                eng.abort(seq_id)
        assert steps < 500
    eng.check_integrity()
    assert eng.blocks.num_free == eng.blocks.num_blocks, "every block comes back"
    out = {}
    for s in seqs:
        mine = [e for e in events if e.seq_id == s.seq_id]
        assert [e.token_id for e in mine] == s.output_ids, "events and output agree"
        assert s.status is SeqStatus.FINISHED and s.num_inflight == 0
        # logprobs rounded: a stopped request's extra row changes the batch, and with it the
        # float summation order (the ids must not change)
        tops = [[(t, round(lp, 4)) for t, lp in e.top] if e.top else None for e in mine]
        out[s.seq_id] = (s.output_ids, s.finish_reason, tops)
    return out


@pytest.mark.parametrize("kinds", ["greedy", "seeded", "penalties", "mixed"])
def test_overlap_generates_what_sync_generates(llama: CausalLM, kinds: str) -> None:
    want = run(engine(llama, False), requests(kinds))
    got = run(engine(llama, True), requests(kinds))
    assert got == want


def test_stop_ids_in_flight(llama: CausalLM) -> None:
    # stop each request on the token it generates third: the overlapped engine has already
    # launched a step with it and must drop that row
    first = run(engine(llama, False), requests("greedy"))
    stops = {i: ids[2] for i, (ids, _, _) in first.items() if len(ids) > 3}
    want = run(engine(llama, False), requests("greedy", stops))
    got = run(engine(llama, True), requests("greedy", stops))
    assert got == want
    assert any(reason == "stop" for _, reason, _ in got.values())


def test_preemption_with_tokens_in_flight(llama: CausalLM) -> None:
    # 14 blocks of 4 tokens cannot hold all six requests: someone is preempted
    want_seqs, got_seqs = requests("mixed"), requests("mixed")
    want = run(engine(llama, False, num_blocks=14), want_seqs)
    got = run(engine(llama, True, num_blocks=14), got_seqs)
    assert got == want
    assert sum(s.num_preemptions for s in got_seqs) > 0


def test_abort_with_a_token_in_flight(llama: CausalLM) -> None:
    eng = engine(llama, True)
    seqs = requests("greedy")
    out = run(eng, seqs, abort={2: 3, 5: 4})
    assert out[2][1] == "abort" and out[5][1] == "abort"
    want = run(engine(llama, False), requests("greedy"))
    for i in (0, 1, 3, 4):
        assert out[i] == want[i]


def test_a_steps_events_come_from_the_next_call(llama: CausalLM) -> None:
    eng = engine(llama, True, budget=64)
    seq = requests("greedy")[0]
    eng.add(seq)
    assert eng.step() == []  # the prompt's step is launched; its token is in flight
    assert seq.num_inflight == 1 and seq.output_ids == []
    events = eng.step()  # launches the next step, then hands out the first token
    assert [e.token_id for e in events] == seq.output_ids and len(seq.output_ids) == 1
