"""The prompt-chunk cap of steps that carry decodes: feedback on step times, bounds, and the
scheduler applying it only when decodes share the step."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLMEngine, Sequence
from shared.engine.chunk_budget import ChunkBudget
from shared.engine.model_runner import ModelRunner
from shared.engine.scheduler import Scheduler
from shared.kv import BlockManager, KVPool
from shared.sampling import SamplingParams
from tests.test_engine import prompt
from tests.test_engine_overlap import llama  # noqa: F401 - fixture

GREEDY = SamplingParams(temperature=0).validate()


def test_slow_mixed_steps_shrink_the_cap_and_fast_full_ones_grow_it() -> None:
    b = ChunkBudget(target_ms=20, max_tokens=2048)
    assert b.cap == 256
    b.observe(True, 256, 0.040)  # twice the target with a full chunk
    assert b.cap == int(256 * 0.9 * 20 / 40)
    shrunk = b.cap
    b.observe(True, 10, 0.080)  # slow, but its chunk was small: not the chunk's fault
    b.observe(False, shrunk, 0.080)  # no decodes waited on it
    b.observe(True, 0, 0.080)  # decodes only
    assert b.cap == shrunk
    for _ in range(40):
        b.observe(True, b.cap, 0.005)  # fast and full: grows to the maximum
    assert b.cap == 2048
    for _ in range(40):
        b.observe(True, b.cap, 1.0)
    assert b.cap == 32  # never below the minimum
    with pytest.raises(ValueError, match="target_ms"):
        ChunkBudget(0, 64)


def test_decodes_slower_than_the_target_leave_the_prompt_half_the_step() -> None:
    b = ChunkBudget(target_ms=20, max_tokens=2048)
    for _ in range(10):
        b.observe(True, 0, 0.024)  # the decodes alone take 24 ms: over the target
    assert b.decode_ms == pytest.approx(24.0) and b.allowed_ms == pytest.approx(48.0)
    for _ in range(40):  # each prompt token adds 0.05 ms: 480 tokens fit in 48 ms
        b.observe(True, b.cap, 0.024 + b.cap * 0.05e-3)
    assert 300 <= b.cap <= 480  # not the 32-token minimum a 20 ms target would force
    fast = ChunkBudget(target_ms=20, max_tokens=2048)
    fast.observe(True, 0, 0.004)  # fast decodes: the target itself bounds the step
    assert fast.allowed_ms == 20


def test_scheduler_caps_prompts_only_beside_decodes() -> None:
    sched = Scheduler(BlockManager(256, 4), 512, 300, 16)
    decoding = Sequence(0, prompt(8, 1), GREEDY, 50)
    sched.add(decoding)
    work = sched.schedule(prefill_cap=16)
    assert work == [(decoding, 8)]  # a prompt alone is not capped: nobody waits on it
    sched.after_step(work)
    decoding.output_ids.append(5)  # now it decodes
    long = Sequence(1, prompt(200, 2), GREEDY, 4)
    sched.add(long)
    work = sched.schedule(prefill_cap=16)
    assert [(s.seq_id, n) for s, n in work] == [(0, 1), (1, 16)]
    assert [(s.seq_id, n) for s, n in sched.schedule(prefill_cap=None)] == [(0, 1), (1, 200)]


def test_engine_with_a_step_target_generates_the_same(llama) -> None:  # noqa: F811
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
        return {s.seq_id: s.output_ids for s in seqs}

    assert run(1e-3) == run(0.0)  # a target nothing meets: chunks at the minimum, same tokens
