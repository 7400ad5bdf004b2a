"""One short generation through a new engine before it serves, so that the first request does
not pay for what runs once per process: CUDA loads a kernel's module at its first launch, and
pinned host buffers and the sampler's greedy and random paths are first used in a real step.

On the H200 the first mixed step of every fresh server took 175-267 ms (BENCHMARKS.md
2026-11-30 (o)), after the step graphs had been captured and replayed once. This is the
engine's whole path, prompt chunk to sampled tokens, once greedy and once sampled.

Then a calibration: prompts of three lengths, one after another, each decoding a few tokens,
give the step cost model (``StepCost``) its first steps of several sizes, so that the chunk
budget sizes the first long prompt beside decodes from this device's numbers, not a guess.
The warm-up's own steps (first launches, first allocations) are left out of the model.
"""

from __future__ import annotations

from shared.engine.engine import LLMEngine
from shared.engine.sequence import Sequence
from shared.sampling import SamplingParams, make_generator

WARM_UP_IDS = (-1, -2)  # sequence ids no request gets (the worker counts from 0)
CALIBRATION_LENGTHS = (8, 64, 192)  # prompt tokens (at most the step's budget)


def warm_up(engine: LLMEngine, device: str, token_id: int = 1) -> None:
    """Generates 3 tokens for a 20-token prompt twice, greedy and sampled; leaves the engine
    with no sequence and every block free (cached prompt blocks stay evictable)."""
    greedy = SamplingParams(temperature=0.0).validate()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=0).validate()
    for seq_id, params in zip(WARM_UP_IDS, (greedy, sampled), strict=True):
        gen = make_generator(params.seed, device)
        engine.add(Sequence(seq_id, [token_id] * 20, params, 3, generator=gen))
    _run(engine)
    budget = engine.chunk_budget
    if budget is None:
        return
    budget.cost.reset()
    # at most a step's budget, and within the context with the 4 tokens each one decodes
    limit = min(engine.scheduler.max_batch_tokens, engine.max_model_len - 4)
    for i, n in enumerate(CALIBRATION_LENGTHS):
        # ids apart from the warm-up's and each other's: no prefix hit shortens a prompt
        ids = [token_id + 1 + (i * 7 + j) % 23 for j in range(min(n, limit))]
        engine.add(Sequence(-3 - i, ids, greedy, 4))
        _run(engine)


def _run(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()
    engine.check_integrity()
