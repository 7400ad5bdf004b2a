"""The start-up generation leaves the engine empty, and what it serves afterwards is what a
fresh engine serves."""

from __future__ import annotations

from shared.engine import LLMEngine, Sequence
from shared.engine.warm_up import warm_up
from shared.sampling import SamplingParams
from tests.test_engine import make_engine, prompt, run_all
from tests.test_engine_overlap import llama  # noqa: F401 - fixture

GREEDY = SamplingParams(temperature=0).validate()


def _serve(engine: LLMEngine) -> dict[int, list[int]]:
    seqs = [Sequence(i, prompt(n, i), GREEDY, 6) for i, n in enumerate((5, 30))]
    for s in seqs:
        engine.add(s)
    run_all(engine)
    engine.check_integrity()
    return {s.seq_id: s.output_ids for s in seqs}


def test_warm_up_leaves_nothing_behind(llama) -> None:  # noqa: F811
    for overlap in (False, True):
        warmed = make_engine(llama, max_model_len=256, overlap=overlap)
        warm_up(warmed, "cpu")
        assert not warmed.has_work()
        assert warmed.blocks.num_free == warmed.blocks.num_blocks
        assert _serve(warmed) == _serve(make_engine(llama, max_model_len=256, overlap=overlap))
