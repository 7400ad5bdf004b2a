"""The start-up generation leaves the engine empty, and what it serves afterwards is what a
fresh engine serves."""

from __future__ import annotations

import torch

from shared.engine import LLMEngine, Sequence
from shared.engine.model_runner import ModelRunner
from shared.engine.warm_up import warm_up
from shared.kv import BlockManager, KVPool
from shared.sampling import SamplingParams
from tests.test_engine import prompt
from tests.test_engine_overlap import llama  # noqa: F401 - fixture

GREEDY = SamplingParams(temperature=0).validate()


def _engine(model, overlap: bool) -> LLMEngine:
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 64, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
    return LLMEngine(ModelRunner(model, kv, "cpu"), BlockManager(64, 4), 256, 64, overlap=overlap)


def _serve(engine: LLMEngine) -> dict[int, list[int]]:
    seqs = [Sequence(i, prompt(n, i), GREEDY, 6) for i, n in enumerate((5, 30))]
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    return {s.seq_id: s.output_ids for s in seqs}


def test_warm_up_leaves_nothing_behind(llama) -> None:  # noqa: F811
    for overlap in (False, True):
        warmed = _engine(llama, overlap)
        warm_up(warmed, "cpu")
        assert not warmed.has_work()
        assert warmed.blocks.num_free == warmed.blocks.num_blocks
        assert _serve(warmed) == _serve(_engine(llama, overlap))
