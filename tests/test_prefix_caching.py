"""Block manager and prefix caching: unit behaviour, identical outputs with caching on and off,
and a randomized run of 1,000 requests (shared prefixes, cancellations, preemption) that must end
with every block free and the integrity check clean."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine import LLMEngine, Sequence
from shared.engine.model_runner import ModelRunner
from shared.kv import BlockManager, KVPool, OutOfBlocks
from shared.kv.block_manager import ROOT_HASH, chain_hash
from shared.loader import GGUFFile
from shared.model import load_model
from shared.sampling import SampleOutput, SamplingParams
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

GREEDY = SamplingParams(temperature=0)


# -- BlockManager --------------------------------------------------------------------------------


def test_freed_blocks_stay_cached_until_reused_in_lru_order() -> None:
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    h0 = bm.commit(a[0], ROOT_HASH, [1, 2])
    bm.commit(a[1], h0, [3, 4])
    bm.free(a)
    assert bm.num_free == 4 and bm.num_cached_free == 2
    blocks, hashes = bm.match_prefix([1, 2, 3, 4, 5], max_blocks=2)
    assert blocks == a and hashes[0] == h0
    bm.check_integrity({a[0]: 1, a[1]: 1})
    bm.free(blocks)
    # the two never-used blocks go first, then the tail block, then the head block
    order = bm.allocate(4)
    assert order[:2] == [2, 3] and order[2:] == [a[1], a[0]]
    assert bm.num_cached_free == 0 and bm.match_prefix([1, 2], 1) == ([], [])


def test_hash_hits_are_checked_against_token_ids() -> None:
    bm = BlockManager(2, 2)
    (b,) = bm.allocate(1)
    h = bm.commit(b, ROOT_HASH, [7, 8])
    bm.free([b])
    bm.tokens[b] = (7, 9)  # a colliding block: same hash, other tokens
    assert bm._index[h] == b
    assert bm.match_prefix([7, 8, 1], 1) == ([], [])


def test_chained_hash_depends_on_parent_tokens_and_extra_key() -> None:
    base = chain_hash(ROOT_HASH, [1, 2, 3])
    assert base == chain_hash(ROOT_HASH, [1, 2, 3])
    assert base != chain_hash(1, [1, 2, 3])
    assert base != chain_hash(ROOT_HASH, [1, 2, 4])
    assert base != chain_hash(ROOT_HASH, [1, 2, 3], b"other-model")


def test_out_of_blocks_and_double_free() -> None:
    bm = BlockManager(2, 4)
    blocks = bm.allocate(2)
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(ValueError):
        bm.free(blocks[:1])


def test_integrity_check_catches_a_leak() -> None:
    bm = BlockManager(3, 2)
    bm.allocate(1)
    with pytest.raises(AssertionError):
        bm.check_integrity({})


# -- engine with a real (tiny) model -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("prefix")
    spec = SynthSpec(
        "llama",
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        vocab=320,
        seed=5,
    )
    return load_model(GGUFFile(write_synthetic_gguf(d / "m.gguf", spec), cache_dir=d), "cpu")


def make_engine(model, prefix_caching: bool, num_blocks: int = 96, block_size: int = 4):
    cfg = model.cfg
    kv = KVPool(
        cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu"
    )
    blocks = BlockManager(num_blocks, block_size, prefix_caching)
    return LLMEngine(ModelRunner(model, kv, "cpu"), blocks, 256, max_batch_tokens=48)


def generate(engine: LLMEngine, prompts: list[list[int]], waves: int) -> list[Sequence]:
    """Runs the prompts in `waves` rounds so later rounds can hit what earlier ones cached."""
    seqs = [Sequence(i, p, GREEDY, 8) for i, p in enumerate(prompts)]
    per = -(-len(seqs) // waves)
    for w in range(waves):
        for s in seqs[w * per : (w + 1) * per]:
            engine.add(s)
        while engine.has_work():
            engine.step()
            engine.check_integrity()
    return seqs


def test_outputs_identical_with_prefix_caching_on_and_off(tiny) -> None:
    rng = random.Random(0)
    system = [rng.randrange(3, 320) for _ in range(23)]
    prompts = [
        system + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 12))] for _ in range(8)
    ]
    prompts += [list(system), system[:16], system[:17]]  # whole-block and exact-block prompts
    off = generate(make_engine(tiny, False), prompts, waves=3)
    on_engine = make_engine(tiny, True)
    on = generate(on_engine, prompts, waves=3)
    assert [s.output_ids for s in on] == [s.output_ids for s in off]
    assert sum(s.num_cached_tokens for s in on) >= 5 * 20  # later waves reused the system prompt
    assert sum(s.num_cached_tokens for s in off) == 0
    assert on_engine.blocks.num_free == on_engine.blocks.num_blocks


# -- randomized stress with a model-free runner ------------------------------------------------


class FakeRunner:
    """Stands in for ModelRunner: emits a token derived from the sequence's length, so outputs are
    deterministic, and checks that every block it is given belongs to the sequence alone or is a
    full, committed block."""

    def __init__(self, block_size: int) -> None:
        self.kv = type("KV", (), {"block_size": block_size})()

    def run(self, work):
        sampled = [s for s, n in work if s.num_computed + n == s.num_tokens]
        ids = torch.tensor([(s.num_tokens * 31 + s.seq_id) % 97 + 3 for s in sampled])
        out = SampleOutput(ids, torch.zeros(len(sampled)), None, None)
        return sampled, (out if sampled else None)


def test_thousand_random_requests_leave_every_block_free() -> None:
    rng = random.Random(1234)
    block_size, num_blocks = 8, 160
    blocks = BlockManager(num_blocks, block_size)
    engine = LLMEngine(FakeRunner(block_size), blocks, 512, max_batch_tokens=96, max_seqs=24)
    prefixes = [[rng.randrange(3, 100) for _ in range(rng.randrange(8, 80))] for _ in range(12)]
    seqs: list[Sequence] = []
    finished = cancelled = 0
    for i in range(1000):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(3, 100) for _ in range(rng.randrange(1, 60))]
        seqs.append(Sequence(i, prompt, GREEDY, rng.randrange(1, 40), frozenset({50})))
        engine.add(seqs[-1])
        for _ in range(rng.randrange(0, 3)):
            for ev in engine.step():
                finished += ev.finish_reason is not None
        live = engine.running + engine.waiting
        if rng.random() < 0.15 and live:
            assert engine.abort(rng.choice(live).seq_id)
            cancelled += 1
        if i % 50 == 0:
            engine.check_integrity()
    while engine.has_work():
        for ev in engine.step():
            finished += ev.finish_reason is not None
    engine.check_integrity()
    assert finished + cancelled == 1000
    assert cancelled > 50
    assert blocks.num_free == num_blocks
    assert blocks.num_cached_free > 0
    assert sum(s.num_cached_tokens for s in seqs) > 1000  # shared prefixes were reused
    assert sum(s.num_preemptions for s in seqs) > 0  # the pool was under pressure
