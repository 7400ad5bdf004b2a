"""LLMEngine on the CPU with tiny synthetic models: greedy output equals full recomputation, and
batching, chunked prefill and preemption do not change what a sequence generates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.engine import LLMEngine, SeqStatus, Sequence, TokenEvent
from shared.engine.model_runner import ModelRunner
from shared.kv import BlockManager, KVPool
from shared.loader import GGUFFile
from shared.model import ForwardBatch, SeqChunk, load_model
from shared.model.causal_lm import CausalLM
from shared.sampling import SamplingParams, make_generator
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

SPECS = {
    "llama": SynthSpec(
        "llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        vocab=320, seed=3,
    ),
    "qwen2": SynthSpec(
        "qwen2", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        vocab=320, seed=3,
    ),
    # Gemma 3 with a sliding window of 8 (5 local : 1 global layers): decode must mask the keys
    # that prefill masked. The runner-ups' logprobs are compared as well as the greedy tokens.
    "gemma3": SynthSpec(
        "gemma3", n_layers=6, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128,
        vocab=320, sliding_window=8, seed=4,
    ),
}  # fmt: skip
GREEDY = SamplingParams(temperature=0)
TOP = 5
GREEDY_TOP = SamplingParams(temperature=0, logprobs=TOP)
REF_BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These models are tiny: several torch threads only spin-wait, and on a busy machine that
    made this file 10x slower (60 s instead of 5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(SPECS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    d = tmp_path_factory.mktemp("engine-models")
    path = write_synthetic_gguf(d / f"{request.param}.gguf", SPECS[request.param])
    return load_model(GGUFFile(path, cache_dir=d / "cache"), "cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    d = tmp_path_factory.mktemp("engine-llama")
    path = write_synthetic_gguf(d / "llama.gguf", SPECS["llama"])
    return load_model(GGUFFile(path, cache_dir=d / "cache"), "cpu")


def make_engine(
    model: CausalLM,
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 128,
    max_batch_tokens: int = 64,
    overlap: bool = False,
) -> LLMEngine:
    cfg = model.cfg
    kv = KVPool(
        cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu"
    )
    runner = ModelRunner(model, kv, "cpu")
    return LLMEngine(
        runner,
        BlockManager(num_blocks, block_size),
        max_model_len,
        max_batch_tokens=max_batch_tokens,
        overlap=overlap,
    )


def run_all(engine: LLMEngine, max_steps: int = 2000) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    steps = 0
    while engine.has_work():
        events += engine.step()
        steps += 1
        assert steps < max_steps, "the engine made no progress"
    return events


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, vocab, n - 1).tolist()


def greedy_seq(seq_id: int, ids: list[int], max_tokens: int, **kw) -> Sequence:
    return Sequence(seq_id, list(ids), GREEDY, max_tokens, **kw)


def full_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] teacher-forced logits, the whole sequence from scratch in a fresh cache."""
    cfg = model.cfg
    n_blocks = -(-len(ids) // REF_BLOCK)
    kv = KVPool(
        cfg.n_layers, n_blocks, REF_BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu"
    )
    chunk = SeqChunk(list(ids), 0, list(range(n_blocks)), "all")
    return model(ForwardBatch.build([chunk], REF_BLOCK, "cpu"), kv)


def reference_greedy(model: CausalLM, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence for every new token."""
    ids = list(ids)
    out = []
    for _ in range(n):
        token = int(full_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


def generate_alone(
    model: CausalLM, ids: list[int], max_tokens: int, params: SamplingParams = GREEDY
) -> list[TokenEvent]:
    engine = make_engine(model)
    seq = Sequence(0, list(ids), params, max_tokens)
    engine.add(seq)
    events = run_all(engine)
    assert [e.token_id for e in events] == seq.output_ids
    return events


def greedy_alone(model: CausalLM, ids: list[int], max_tokens: int) -> list[int]:
    return [e.token_id for e in generate_alone(model, ids, max_tokens)]


def tokens_by_seq(events: list[TokenEvent]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        out.setdefault(e.seq_id, []).append(e.token_id)
    return out


def assert_same_events(got: list[TokenEvent], want: list[TokenEvent]) -> None:
    """Same tokens; logprobs and top lists equal up to float noise (near-tied runner-ups may
    swap ranks or, at the last rank, places with the next token)."""
    assert [e.token_id for e in got] == [e.token_id for e in want]
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=1e-4)
    for g, w in zip(got, want, strict=True):
        assert len(g.top) == len(w.top)
        np.testing.assert_allclose([lp for _, lp in g.top], [lp for _, lp in w.top], atol=1e-4)
        gd, wd = dict(g.top), dict(w.top)
        common = gd.keys() & wd.keys()
        assert len(common) >= len(g.top) - 1
        np.testing.assert_allclose([gd[t] for t in common], [wd[t] for t in common], atol=1e-4)


# -- correctness against recomputation and invariance to batching ---------------------------------


def test_greedy_equals_full_recomputation(model: CausalLM) -> None:
    ids = prompt(11, seed=0)
    ref = reference_greedy(model, ids, 12)
    if not model.cfg.tied_embeddings:
        assert len(set(ref)) > 4, "degenerate reference: the check would be weak"

    engine = make_engine(model, block_size=4)
    seq = Sequence(7, list(ids), GREEDY_TOP, 12)
    engine.add(seq)
    events = run_all(engine)
    assert seq.output_ids == ref
    assert [e.token_id for e in events] == ref
    assert all(e.seq_id == 7 for e in events)
    assert [e.finish_reason for e in events] == [None] * 11 + ["length"]
    assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
    # every logprob the engine reports is log_softmax of the recomputed logits at its position
    logits = full_logits(model, ids + ref[:-1])[len(ids) - 1 :]
    logprobs = torch.log_softmax(logits, -1)
    for i, e in enumerate(events):
        assert e.logprob == pytest.approx(float(logprobs[i, e.token_id]), abs=1e-4)
        top_ids = [t for t, _ in e.top]
        want = logprobs[i, top_ids].numpy()
        np.testing.assert_allclose([lp for _, lp in e.top], want, atol=1e-4)
        kth = float(logprobs[i].topk(TOP).values[-1])
        assert min(want) >= kth - 1e-4  # they are the top TOP
        assert top_ids[0] == e.token_id
    # the runner-ups are informative (not all -inf or equal)
    assert len({round(lp, 3) for e in events for _, lp in e.top[1:]}) > 10


PROMPT_LENS = [5, 17, 33, 2, 40, 9]


def test_batching_invariance(model: CausalLM) -> None:
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(PROMPT_LENS)]
    alone = [generate_alone(model, p, 10, GREEDY_TOP) for p in prompts]

    engine = make_engine(model, block_size=4, max_batch_tokens=24)
    steps: list[list[tuple[int, int, int]]] = []  # per step: (seq_id, start, n)
    run = engine.runner.run

    def recording_run(work):
        steps.append([(s.seq_id, s.num_computed, n) for s, n in work])
        return run(work)

    engine.runner.run = recording_run
    seqs = [Sequence(i, p, GREEDY_TOP, 10) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add(s)
    events = run_all(engine)

    for s, want in zip(seqs, alone, strict=True):
        assert s.output_ids == [e.token_id for e in want]
        assert_same_events([e for e in events if e.seq_id == s.seq_id], want)
    assert all(s.finish_reason == "length" for s in seqs)
    # the schedule really mixed things: batches of several sequences, prompts split into chunks,
    # and steps running a decode beside a prompt chunk
    plen = dict(enumerate(PROMPT_LENS))
    assert max(len(w) for w in steps) >= 3
    assert all(sum(n for _, _, n in w) <= 24 for w in steps)
    chunked = {i for w in steps for i, start, n in w if start < plen[i] and start + n < plen[i]}
    assert chunked, "no prompt was prefilled in chunks"
    decoding = [any(st >= plen[i] for i, st, _ in w) for w in steps]
    prefilling = [any(st < plen[i] for i, st, _ in w) for w in steps]
    mixed = [w for w, d, p in zip(steps, decoding, prefilling, strict=True) if d and p]
    assert mixed, "no step ran decodes together with a prompt chunk"
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.check_integrity()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_preemption_keeps_outputs(llama: CausalLM, sampling: str) -> None:
    num_blocks, block_size, max_tokens = 12, 4, 12
    prompts = [prompt(n, seed=20 + i) for i, n in enumerate([9, 14, 6, 21, 11, 3])]

    def make_seq(i: int) -> Sequence:
        if sampling == "greedy":
            return greedy_seq(i, prompts[i], max_tokens)
        seed = 1000 + i
        params = SamplingParams(temperature=1.0, seed=seed)
        return Sequence(
            i, list(prompts[i]), params, max_tokens, generator=make_generator(seed, "cpu")
        )

    alone = []
    for i in range(len(prompts)):
        engine = make_engine(llama)
        engine.add(seq := make_seq(i))
        run_all(engine)
        alone.append(seq.output_ids)
    # together they need far more than 12 blocks; each alone fits (21 + 12 tokens = 9 blocks)
    assert sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) > 2 * num_blocks

    engine = make_engine(llama, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=32)
    seqs = [make_seq(i) for i in range(len(prompts))]
    for s in seqs:
        engine.add(s)
    events: list[TokenEvent] = []
    for _ in range(1000):
        if not engine.has_work():
            break
        events += engine.step()
        used = sum(len(s.block_table) for s in seqs)
        assert used + engine.blocks.num_free == num_blocks
        engine.check_integrity()
    else:
        pytest.fail("the engine made no progress")

    assert sum(s.num_preemptions for s in seqs) >= 2, "the scenario hardly preempted"
    assert [s.output_ids for s in seqs] == alone
    assert tokens_by_seq(events) == dict(enumerate(alone))  # no token emitted twice or lost
    assert all(s.finish_reason == "length" and s.block_table == [] for s in seqs)
    assert engine.blocks.num_free == num_blocks
    engine.check_integrity()


# -- request lifecycle ---------------------------------------------------------------------------


def test_abort_frees_blocks(llama: CausalLM) -> None:
    engine = make_engine(llama, num_blocks=32, block_size=4)
    a = greedy_seq(1, prompt(13, seed=1), 20)
    b = greedy_seq(2, prompt(6, seed=2), 20)
    c = greedy_seq(3, prompt(5, seed=3), 20)
    engine.add(a)
    engine.add(b)
    for _ in range(3):
        engine.step()
    assert a.status is SeqStatus.RUNNING and len(a.output_ids) == 3
    held = len(a.block_table)
    assert held == 4  # 13 + 2 computed tokens (and 1 pending) in blocks of 4
    free_before = engine.blocks.num_free

    assert engine.abort(1) is True
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "abort"
    assert a.block_table == []
    assert engine.blocks.num_free == free_before + held
    assert a not in engine.running
    assert engine.abort(1) is False  # already gone
    assert engine.abort(99) is False

    engine.add(c)  # waiting, holds no blocks yet
    assert engine.abort(3) is True
    assert c.finish_reason == "abort" and c not in engine.waiting

    events = run_all(engine)
    assert {e.seq_id for e in events} == {2}
    assert b.finish_reason == "length" and len(b.output_ids) == 20
    assert len(a.output_ids) == 3 and c.output_ids == []
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.check_integrity()


def test_max_tokens_finishes_with_length(llama: CausalLM) -> None:
    engine = make_engine(llama)
    seqs = [greedy_seq(i, prompt(8, seed=i), n) for i, n in enumerate([1, 4, 9])]
    for s in seqs:
        engine.add(s)
    events = run_all(engine)
    for s, n in zip(seqs, [1, 4, 9], strict=True):
        mine = [e for e in events if e.seq_id == s.seq_id]
        assert len(s.output_ids) == n and len(mine) == n
        assert [e.finish_reason for e in mine] == [None] * (n - 1) + ["length"]
        assert s.finish_reason == "length"


def test_stop_id_finishes_with_stop(llama: CausalLM) -> None:
    ids = prompt(10, seed=5)
    ref = greedy_alone(llama, ids, 12)
    # the first token that is new at its position and not the first one
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    engine = make_engine(llama)
    seq = greedy_seq(0, ids, 12, stop_ids=frozenset({ref[k], 100000}))
    engine.add(seq)
    events = run_all(engine)
    assert seq.output_ids == ref[: k + 1]  # the stop token is included, nothing after it
    assert seq.finish_reason == "stop"
    assert events[-1].finish_reason == "stop" and events[-1].token_id == ref[k]
    assert all(e.finish_reason is None for e in events[:-1])
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_stop_beats_length_on_the_last_token(llama: CausalLM) -> None:
    ids = prompt(10, seed=5)
    ref = greedy_alone(llama, ids, 12)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    engine = make_engine(llama)
    seq = greedy_seq(0, ids, k + 1, stop_ids=frozenset({ref[k]}))
    engine.add(seq)
    events = run_all(engine)
    assert seq.output_ids == ref[: k + 1]
    assert seq.finish_reason == "stop" and events[-1].finish_reason == "stop"


def test_rejected_prompts(llama: CausalLM) -> None:
    engine = make_engine(llama, num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add(greedy_seq(0, [], 4))
    with pytest.raises(ValueError, match="context length 64"):
        engine.add(greedy_seq(1, prompt(65, seed=0), 1))
    with pytest.raises(ValueError, match="context length 64"):
        engine.add(greedy_seq(2, prompt(60, seed=0), 5))  # prompt fits, max_tokens does not
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add(greedy_seq(3, prompt(30, seed=0), 5))  # 35 tokens > 8 blocks x 4
    assert not engine.has_work()
    ok = greedy_seq(4, prompt(28, seed=0), 4)  # exactly 32 tokens = 8 blocks: accepted
    engine.add(ok)
    run_all(engine)
    assert len(ok.output_ids) == 4 and ok.finish_reason == "length"
