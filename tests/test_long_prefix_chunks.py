"""Steps that carry decodes and a chunk over a long cached prefix stay within long_prefix_step
tokens (the scheduler), and generate the same tokens as unlimited steps (the engine)."""

from __future__ import annotations

import pytest

from shared.engine import Sequence
from shared.engine import scheduler as sched_mod
from shared.engine.scheduler import Scheduler
from shared.kv import BlockManager
from shared.sampling import SamplingParams
from tests.test_engine import make_engine, prompt, run_all
from tests.test_engine_overlap import llama  # noqa: F401 - fixture

GREEDY = SamplingParams(temperature=0).validate()


@pytest.mark.parametrize(("step", "want"), [(64, 63), (0, 108), (20, 32)])
def test_long_prefix_chunk_beside_decodes(monkeypatch, step: int, want: int) -> None:
    monkeypatch.setattr(sched_mod, "LONG_PREFIX", 32)
    sched = Scheduler(BlockManager(256, 4), 512, 300, 16, long_prefix_step=step)
    decoding = Sequence(0, prompt(8, 1), GREEDY, 50)
    long = Sequence(1, prompt(400, 2), GREEDY, 4)
    sched.add(decoding)
    sched.add(long)
    work = sched.schedule()
    assert [(s.seq_id, n) for s, n in work] == [(0, 8), (1, 292)]  # no decodes yet: no limit
    sched.after_step(work)
    decoding.output_ids.append(5)  # now it decodes; the long prompt has 292 cached tokens
    # the step keeps to `step` tokens with its decode (20: the chunk's 32-token floor)
    assert [(s.seq_id, n) for s, n in sched.schedule()] == [(0, 1), (1, want)]


def test_short_prefix_chunks_are_not_limited() -> None:
    sched = Scheduler(BlockManager(256, 4), 512, 300, 16, long_prefix_step=64)
    decoding = Sequence(0, prompt(8, 1), GREEDY, 50)
    sched.add(decoding)
    sched.after_step(sched.schedule())
    decoding.output_ids.append(5)
    sched.add(Sequence(1, prompt(400, 2), GREEDY, 4))  # admitted beside a decode, no prefix
    assert [(s.seq_id, n) for s, n in sched.schedule()] == [(0, 1), (1, 299)]


def test_engine_generates_the_same_with_the_limit(llama, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(sched_mod, "LONG_PREFIX", 16)

    def run(step: int) -> dict[int, list[int]]:
        eng = make_engine(llama, num_blocks=128, max_model_len=256)
        eng.scheduler.long_prefix_step = step
        seqs = [Sequence(i, prompt(n, i), GREEDY, 8) for i, n in enumerate((4, 150, 33))]
        for s in seqs:
            eng.add(s)
        run_all(eng)
        eng.check_integrity()
        return {s.seq_id: s.output_ids for s in seqs}

    assert run(8) == run(0)
