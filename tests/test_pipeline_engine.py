"""Pipeline stages in real processes (shared.pipeline), through the engine on the CPU.

- Greedy tokens of several prompts at once (prompt chunks beside decodes, micro-batches) are
  those of one stage, on SmolLM2 (two and three stages).
- micro_batches cuts a step's sequences into groups of about equal tokens, keeping each
  sequence's rows and the logits rows' order.
- A SpanStep (what a stage's CUDA graphs capture) computes its layers' output; on a GPU, two
  stages replaying graphs give one stage's greedy tokens.
- A stage killed mid-run makes the next step raise StageLost (no hang); a stage that fails to
  load is named in the error, and a bad split or device is refused before any stage starts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from shared.engine import Sequence
from shared.engine.factory import EngineConfig, build_engine
from shared.kv import KVPool
from shared.loader import GGUFFile
from shared.model import load_model
from shared.model.batch import ForwardBatch, SeqChunk
from shared.model.causal_lm import LayerSpan
from shared.pipeline.lead import Pipeline, StageLost, StageOptions, StageSpec, micro_batches
from shared.pipeline.span_step import SpanStep
from shared.sampling import SamplingParams
from tools.synthetic_gguf import SynthSpec, synthetic

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    " * 6,
    "A short story about a lighthouse keeper who finds a message in a bottle. " * 4,
]


def _engine(
    path: Path,
    stages: tuple[str, ...] = (),
    split: tuple[int, ...] = (),
    memory_gib: tuple[float, ...] = (),
):
    # small steps: the long prompts go in chunks beside the others' decodes
    cfg = EngineConfig(
        model_path=str(path), kv_blocks=96, max_batch_tokens=48, stages=stages,
        layer_split=split, memory_gib=memory_gib,
    )  # fmt: skip
    return build_engine(cfg)


def _generate(loaded, prompts: list[str], max_tokens: int = 10) -> dict[int, list[int]]:
    greedy = SamplingParams(temperature=0.0).validate()
    for i, p in enumerate(prompts):
        ids = loaded.tokenizer.encode(p)
        loaded.engine.add(Sequence(i, ids, greedy, max_tokens, frozenset(), None))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while loaded.engine.has_work():
        for ev in loaded.engine.step():
            out[ev.seq_id].append(ev.token_id)
    loaded.engine.check_integrity()
    return out


@pytest.fixture(scope="module")
def one_stage(smollm2_path: Path) -> dict[int, list[int]]:
    loaded = _engine(smollm2_path)
    try:
        return _generate(loaded, PROMPTS)
    finally:
        loaded.close()


# two stages as planned, three as asked (Gemma 3 through the gateway: test_pipeline_e2e.py)
@pytest.mark.parametrize("stages, split", [(("cpu",), ()), (("cpu", "cpu"), (4, 20, 6))])
def test_greedy_tokens_equal_one_stage(stages, split, smollm2_path: Path, one_stage) -> None:
    piped = _engine(smollm2_path, stages, split)
    try:
        assert len(piped.engine.runner.model.procs) == len(stages)
        got = _generate(piped, PROMPTS)
    finally:
        piped.close()
    assert got == one_stage
    assert all(len(t) == 10 for t in got.values())


def _batch(lengths: list[int], logits: list[str]) -> ForwardBatch:
    chunks, block = [], 0
    for n, want in zip(lengths, logits, strict=True):
        blocks = -(-(n + 3) // 4)
        chunks.append(SeqChunk(list(range(n)), 3, list(range(block, block + blocks)), want))
        block += blocks
    return ForwardBatch.build(chunks, 4, "cpu")


def test_micro_batches_keep_sequences_and_rows_in_order() -> None:
    batch = _batch([9, 1, 1, 7, 1, 1], ["last", "last", "last", "none", "all", "last"])
    parts = micro_batches(batch, 3, torch.device("cpu"))
    assert len(parts) == 3
    assert [len(p.seq_lens) for p in parts] == [1, 3, 2]  # 9 | 1 1 7 | 1 1 tokens
    for field in ("token_ids", "positions", "slot_mapping"):
        joined = torch.cat([getattr(p, field) for p in parts])
        assert torch.equal(joined, getattr(batch, field)), field
    offsets = [0, 9, 9 + 1 + 1 + 7]
    rows = torch.cat([p.logits_rows + o for p, o in zip(parts, offsets, strict=True)])
    assert torch.equal(rows, batch.logits_rows)
    assert sum(p.block_tables.shape[0] for p in parts) == 6
    assert parts[1].query_start_loc == [0, 1, 2, 9] and parts[1].max_query_len == 7
    assert micro_batches(_batch([5], ["last"]), 3, torch.device("cpu"))[0].seq_lens == [8]


def test_a_killed_stage_fails_the_next_step(smollm2_path: Path) -> None:
    piped = _engine(smollm2_path, ("cpu",), (15, 15))
    try:
        proc = piped.engine.runner.model.procs[0]
        greedy = SamplingParams(temperature=0.0).validate()
        ids = piped.tokenizer.encode(PROMPTS[2])
        piped.engine.add(Sequence(0, ids, greedy, 64, frozenset(), None))
        piped.engine.step()
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StageLost, match=r"stage 1 \(cpu, layers 15-29\) exited"):
            while piped.engine.has_work():
                piped.engine.step()
        assert time.monotonic() - start < 10
    finally:
        piped.close()


def test_a_bad_split_or_device_is_refused_at_start(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match="sums to 20, the model has 30"):
        _engine(smollm2_path, ("cpu",), (10, 10))
    with pytest.raises(ValueError, match="pipeline over cpu,nowhere:0: device nowhere:0"):
        _engine(smollm2_path, ("nowhere:0",), (15, 15))
    # a stage without memory for its part: the numbers (weights, KV, reserve; free)
    with pytest.raises(ValueError, match=r"cpu, the first stage, .* needs .* 0\.05 GiB free"):
        _engine(smollm2_path, ("cpu",), memory_gib=(0.05, 1.0))
    with pytest.raises(ValueError, match="2 values for 3 stages"):
        _engine(smollm2_path, ("cpu", "cpu"), memory_gib=(1.0, 1.0))


def test_a_stage_that_fails_to_load_is_named(smollm2_path: Path, tmp_path: Path) -> None:
    model = load_model(GGUFFile(smollm2_path), span=LayerSpan(0, 15, True))
    kv = KVPool(15, 8, 16, model.cfg.n_kv_heads, model.cfg.head_dim, torch.float32, "cpu")
    opts = StageOptions(str(tmp_path / "missing.gguf"), kv_blocks=8)
    cpu = torch.device("cpu")
    pipeline = Pipeline(model, kv, [StageSpec("cpu", 15, 30)], opts, cpu, torch.float32)
    try:
        with pytest.raises(StageLost, match=r"stage 1 \(cpu, layers 15-29\) failed: .*missing"):
            pipeline.wait_ready(timeout=120)
    finally:
        pipeline.close()


def test_a_span_step_gives_its_layers_output(smollm2_path: Path) -> None:
    """SpanStep (what a stage's CUDA graphs capture) computes what run_layers does: stage 0
    from the tokens, a later stage from the rows loaded into its inputs; x then the residual
    in one output row."""
    f = GGUFFile(smollm2_path)
    front = load_model(f, span=LayerSpan(0, 12, True))
    back = load_model(f, span=LayerSpan(12, 30, False))
    assert front.residual_stream and back.residual_stream
    kvs = [KVPool(n, 8, 4, front.cfg.n_kv_heads, front.cfg.head_dim, torch.float32, "cpu")
           for n in (12, 18)]  # fmt: skip
    batch = _batch([5, 3], ["last", "last"])
    want_x, want_res, _ = front.run_layers(front.embed_batch(batch), None, batch, kvs[0])
    want = back.run_layers(want_x, want_res, batch, kvs[1])
    cpu = torch.device("cpu")
    first = SpanStep(front, 16, True, torch.float32, cpu)
    x, res = first.split(first(batch, kvs[0]))
    assert torch.equal(x, want_x) and torch.equal(res, want_res)
    later = SpanStep(back, 16, False, torch.float32, cpu)
    later.load(x, res)
    out = torch.full((batch.token_ids.shape[0], later.out_width), float("nan"))
    x2, res2 = later.split(later(batch, kvs[1], out))
    assert torch.equal(x2, want[0]) and torch.equal(res2, want[1])


@pytest.mark.gpu
def test_cuda_stages_replay_graphs_and_equal_one_stage(synthetic_dir: Path) -> None:
    """Two stages on one GPU (two processes), both capturing their decode steps: greedy tokens
    equal one stage's, and stage 0's decode steps replayed graphs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = SynthSpec(arch="llama", n_layers=4, d_model=512, n_heads=8, n_kv_heads=2,
                     ffn_dim=1024, vocab=1024)  # fmt: skip
    path = synthetic(spec, "Q4_K_M", synthetic_dir)

    def run(stages: tuple[str, ...]) -> tuple[dict[int, list[int]], int]:
        cfg = EngineConfig(
            model_path=str(path), device="cuda:0", dtype="bfloat16", kv_blocks=96,
            max_batch_tokens=48, max_seqs=8, stages=stages, layer_split=(2, 2) if stages else (),
        )  # fmt: skip
        loaded = build_engine(cfg)
        try:
            greedy = SamplingParams(temperature=0.0).validate()
            for i in range(3):
                ids = [1, *range(10 + 7 * i, 30 + 11 * i)]
                loaded.engine.add(Sequence(i, ids, greedy, 12, frozenset(), None))
            out: dict[int, list[int]] = {i: [] for i in range(3)}
            while loaded.engine.has_work():
                for ev in loaded.engine.step():
                    out[ev.seq_id].append(ev.token_id)
            pipe = loaded.pipeline
            return out, (pipe.graphs.replays["decode"] if pipe and pipe.graphs else 0)
        finally:
            loaded.close()

    one, _ = run(())
    two, replays = run(("cuda:0",))
    assert two == one
    assert replays > 0
