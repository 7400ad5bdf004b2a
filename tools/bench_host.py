"""Host-side cost of one engine step: scheduling, building the batch, sampling and bookkeeping
around a model that returns at once (so only the CPU work is timed).

    python -m tools.bench_host [--seqs 64] [--steps 200] [--device cpu|cuda:0]

C sequences with 512-token prompts are prefilled, then decode steps are timed with the wall
clock (median ms per step). On a GPU the model still does nothing, so the figure is the host
time the engine adds to every step, the one that CUDA graphs cannot hide.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from shared.engine import LLMEngine, Sequence
from shared.engine.model_runner import ModelRunner
from shared.kv import BlockManager, KVPool
from shared.sampling import SamplingParams


class InstantModel:
    """Stands in for a CausalLM: logits of zeros for the requested rows."""

    def __init__(self, vocab: int, device: str) -> None:
        self.vocab, self.device = vocab, device

    def __call__(self, batch, kv) -> torch.Tensor:
        return torch.zeros(batch.logits_rows.shape[0], self.vocab, device=self.device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    blocks = a.seqs * (512 + a.steps + 32) // 16 + 16
    kv = KVPool(1, blocks, 16, 1, 8, torch.float32, a.device)
    runner = ModelRunner(InstantModel(a.vocab, a.device), kv, a.device)
    engine = LLMEngine(runner, BlockManager(blocks, 16), 4096, 2048, max(256, a.seqs))
    for i in range(a.seqs):
        prompt = [(i * 7919 + t) % a.vocab for t in range(512)]
        engine.add(Sequence(i, prompt, SamplingParams(temperature=0), a.steps + 8, frozenset()))
    while any(s.num_computed < len(s.prompt_ids) for s in engine.running + engine.waiting):
        engine.step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    print(
        f"{a.seqs} sequences decoding on {a.device}: {statistics.median(times) * 1e3:.3f} ms per "
        f"step (median of {a.steps}; p90 {sorted(times)[int(0.9 * len(times))] * 1e3:.3f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
