"""The step cost model and the chunk budget built on it: the fit, the chunk it allows, the
scheduler applying it only beside decodes, prompts taking turns, and a simulated device on which
decoding streams keep their pace while a long prompt prefills (deterministic: a fake cost)."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from shared.engine import LLMEngine, Sequence
from shared.engine.chunk_budget import COLD_TOKENS, MIN_TOKENS, ChunkBudget
from shared.engine.model_runner import ModelRunner
from shared.engine.scheduler import PREFILL_QUANTUM, Scheduler
from shared.engine.step_cost import StepCost, chunk_pairs
from shared.kv import BlockManager, KVPool
from shared.sampling import SamplingParams
from tests.test_engine import prompt
from tests.test_engine_overlap import llama  # noqa: F401 - fixture

GREEDY = SamplingParams(temperature=0).validate()


def fake_ms(tokens: int, pairs: int, base: float = 50.0, per_token: float = 1.0) -> float:
    """Two CPU cores and SmolLM2, roughly: a step's fixed cost, its rows, its attention."""
    return base + per_token * tokens + 2e-4 * pairs


def trained(cost=fake_ms, **kw) -> ChunkBudget:
    b = ChunkBudget(512, **kw)
    for tokens, ctx in [(1, 10), (3, 300), (40, 0), (128, 64), (300, 500), (512, 2000)]:
        pairs = chunk_pairs(tokens, ctx)
        b.observe(tokens, pairs, cost(tokens, pairs) / 1e3)
    return b


def test_the_fit_recovers_a_linear_cost_and_ignores_a_pause() -> None:
    rng = np.random.default_rng(0)
    c = StepCost()
    assert not c.ready
    for _ in range(200):
        t, p = int(rng.integers(1, 512)), int(rng.integers(0, 2_000_000))
        c.observe(t, p, fake_ms(t, p) * (1 + rng.normal(0, 0.01)) / 1e3)
    c.observe(3, 900, 2.0)  # a two-second pause of the process
    c.refit()
    assert c.ready
    assert c.coef == pytest.approx([50.0, 1.0, 0.2], rel=0.05)  # pairs in thousands
    assert c.predict_ms(100, 5000) == pytest.approx(fake_ms(100, 5000), rel=0.02)


def test_a_long_prefill_does_not_make_it_forget_the_decode_steps() -> None:
    c = trained().cost
    for i in range(400):  # every step alike in rows while a long prompt prefills
        pairs = chunk_pairs(3, 300) + chunk_pairs(18, 18 * i)
        c.observe(21, pairs, fake_ms(21, pairs) / 1e3)
    assert c.predict_ms(3, 900) == pytest.approx(fake_ms(3, 900), rel=0.05)
    assert c.predict_ms(21, 200_000) == pytest.approx(fake_ms(21, 200_000), rel=0.05)


def test_coefficients_stay_non_negative() -> None:
    c = StepCost()
    for t, ms in [(1, 30.0), (2, 29.0), (3, 28.0), (4, 27.5)]:  # time falling with rows: noise
        c.observe(t, 0, ms / 1e3)
    assert (c.coef >= 0).all() and c.predict_ms(1, 0) == pytest.approx(28.6, abs=1.5)


def test_the_chunk_keeps_the_step_within_twice_the_decodes() -> None:
    b = trained()
    decode = fake_ms(3, 900)  # three streams at 300 tokens
    assert b.allowed_ms(3, 900) == pytest.approx(2 * decode, rel=0.01)
    n = b.chunk(3, 900, 0, 3000, b.allowed_ms(3, 900))
    assert fake_ms(3 + n, 900 + chunk_pairs(n, 0)) <= 2 * decode * 1.01
    assert fake_ms(3 + n + 2, 900 + chunk_pairs(n + 2, 0)) > 2 * decode * 0.99  # the most
    # deeper into a long prompt each token reads more keys: smaller chunks for the same step
    assert b.chunk(3, 900, 20_000, 3000, b.allowed_ms(3, 900)) < n
    assert b.chunk(3, 900, 0, 7, b.allowed_ms(3, 900)) == 7  # never more than the prompt has


def test_floor_target_cold_start_and_minimum() -> None:
    fast = trained(lambda t, p: 0.5 + 0.01 * t)  # a GPU: half-millisecond decode steps
    assert fast.allowed_ms(1, 10) == 20.0  # the floor, not 1 ms
    assert fast.chunk(1, 10, 0, 5000, 20.0) == 512  # bounded by the step's token budget
    assert trained(target_ms=300).allowed_ms(3, 900) == 300.0  # --step-target-ms
    cold = ChunkBudget(512)
    assert cold.chunk(3, 900, 0, 5000, cold.allowed_ms(3, 900)) == COLD_TOKENS
    slow = trained(lambda t, p: 50 + 20.0 * t)  # tokens dearer than the step allows
    assert slow.chunk(3, 900, 0, 5000, slow.allowed_ms(3, 900)) == MIN_TOKENS
    with pytest.raises(ValueError, match="target_ms"):
        ChunkBudget(64, target_ms=-1)


def test_scheduler_caps_prompts_only_beside_decodes() -> None:
    sched = Scheduler(BlockManager(256, 4), 512, 300, 16)
    budget = trained()
    decoding = Sequence(0, prompt(8, 1), GREEDY, 50)
    sched.add(decoding)
    work = sched.schedule(budget=budget)
    assert work == [(decoding, 8)]  # a prompt alone is not capped: nobody waits on it
    sched.after_step(work)
    decoding.output_ids.append(5)  # now it decodes
    long = Sequence(1, prompt(200, 2), GREEDY, 4)
    sched.add(long)
    work = sched.schedule(budget=budget)
    pairs = chunk_pairs(1, 8)  # the decode's row over its 8 tokens and itself
    want = budget.chunk(1, pairs, 0, 200, budget.allowed_ms(1, pairs))
    assert [(s.seq_id, n) for s, n in work] == [(0, 1), (1, want)] and 18 <= want < 80
    assert [(s.seq_id, n) for s, n in sched.schedule()] == [(0, 1), (1, 200)]  # no budget


def _served_order(
    sched: Scheduler, steps: int, done: list[int] | None = None
) -> list[list[tuple[int, int]]]:
    """The prompt chunks of the next steps (decodes left out); done collects the ids of the
    prompts as they finish."""
    out = []
    for _ in range(steps):
        work = sched.schedule()
        out.append([(s.seq_id, n) for s, n in work if not s.output_ids])
        sched.after_step(work)
        for s, _ in work:
            if s.num_pending == 0:
                if not s.output_ids and done is not None:
                    done.append(s.seq_id)
                s.output_ids.append(1)  # a token: it decodes from now on
    return out


def test_long_prompts_take_turns_and_a_short_one_goes_first() -> None:
    q = PREFILL_QUANTUM
    sched = Scheduler(BlockManager(4096, 16), 8 * q, q, 16)
    a, b = Sequence(0, prompt(3 * q, 1), GREEDY, 4), Sequence(1, prompt(3 * q, 2), GREEDY, 4)
    sched.add(a)
    sched.add(b)
    steps = _served_order(sched, 3)
    assert steps == [[(0, q)], [(1, q)], [(0, q)]]  # a quantum each, by turns
    short = Sequence(2, prompt(100, 3), GREEDY, 4)
    sched.add(short)
    # b has had one quantum, a two: the newcomer (none) first, then b
    assert _served_order(sched, 1) == [[(2, 100), (1, q - 100)]]


def test_equal_prompts_arriving_together_are_served_first_come_first_served() -> None:
    sched = Scheduler(BlockManager(1024, 16), 4096, 512, 64)
    seqs = [Sequence(i, prompt(512, i), GREEDY, 4) for i in range(6)]
    for s in seqs:
        sched.add(s)
    done: list[int] = []
    _served_order(sched, 8, done)
    assert done == list(range(6))  # W2's burst: first come, first served


def _simulate(budget: ChunkBudget | None, long_len: int) -> tuple[list[float], list[float], float]:
    """Three streams decode, then a long prompt arrives; the device is fake_ms. Returns the
    streams' gaps before and during its prefill, and its time to first token (ms)."""
    sched = Scheduler(BlockManager(2048, 16), 16384, 512, 16)
    streams = [Sequence(i, prompt(128, i), GREEDY, 10_000) for i in range(3)]
    for s in streams:
        sched.add(s)
    clock, last, before, during = 0.0, {}, [], []
    long, arrived, ttft = None, None, None
    for step in range(5000):
        if step == 20:
            long, arrived = Sequence(9, prompt(long_len, 9), GREEDY, 1), clock
            sched.add(long)
        work = sched.schedule(budget=budget)
        tokens = sum(n for _, n in work)
        pairs = sum(chunk_pairs(n, s.num_computed) for s, n in work)
        ms = fake_ms(tokens, pairs)
        clock += ms
        if budget is not None:
            budget.observe(tokens, pairs, ms / 1e3)
        sched.after_step(work)
        for s, _ in work:
            if s.num_pending == 0:
                s.output_ids.append(1)
                if s in streams:
                    if s.seq_id in last:
                        (during if long is not None and ttft is None else before).append(
                            clock - last[s.seq_id]
                        )
                    last[s.seq_id] = clock
                elif s is long:
                    ttft = clock - arrived
                    return before, during, ttft
    raise AssertionError("the long prompt never finished")


@pytest.mark.parametrize("long_len", [3000, 6000])
def test_streams_keep_their_pace_and_the_prompt_its_bound(long_len: int) -> None:
    before, during, ttft = _simulate(trained(), long_len)
    _, fixed_during, fixed_ttft = _simulate(None, long_len)
    gap = statistics.median(before)
    assert statistics.median(during) <= 2.0 * gap * 1.02
    assert max(during) <= 4.0 * gap
    assert max(fixed_during) > 10 * gap  # what a fixed 512-token budget does to them
    # the prompt gets about half of every step it shares: about twice its fixed-budget time
    assert ttft <= 2.3 * fixed_ttft


def test_engine_generates_the_same_with_and_without_the_budget(llama) -> None:  # noqa: F811
    def run(target: float) -> dict[int, list[int]]:
        cfg = llama.cfg
        kv = KVPool(cfg.n_layers, 128, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
        eng = LLMEngine(
            ModelRunner(llama, kv, "cpu"), BlockManager(128, 4), 256, 64, step_target_ms=target
        )
        seqs = [Sequence(i, prompt(n, i), GREEDY, 8) for i, n in enumerate((4, 90, 33))]
        for s in seqs:
            eng.add(s)
        while eng.has_work():
            eng.step()
        eng.check_integrity()
        if target >= 0:
            assert len(eng.chunk_budget.cost.samples) > 0  # every step is measured
        return {s.seq_id: s.output_ids for s in seqs}

    assert run(0.0) == run(-1.0) == run(1e-3)  # auto, off, and a floor nothing meets
