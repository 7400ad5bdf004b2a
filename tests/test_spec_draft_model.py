"""The spec service's draft-model proposer (services/spec/draft_model.py) on SmolLM2: with the
target itself as the draft its guesses are the target's greedy continuation; a draft cut to the
first layers (tools/truncate_gguf.py, written into a tmp dir) proposes at most k tokens, batched
asks answer as single ones, a cut copy's rolled-back K/V proposes as a fresh sequence does, a
tiny pool evicts the least recently asked; the vocabulary check names both files and the id;
the service answers "draft" where prompt lookup finds nothing and frees what it held. CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.spec.draft_model import BLOCK_SIZE, DraftModel
from services.spec.metrics import SpecCollector, SpecStats, summary
from services.spec.sequences import LiveSequences
from services.spec.service import SpecService
from services.spec.vocab_check import VocabMismatch, check_vocab
from shared.cli import main as skiff
from shared.kv import KVPool
from shared.loader import GGUFFile
from shared.model import ForwardBatch, SeqChunk
from shared.protocol import SpecAsk, SpecDrafts, SpecEnd, SpecSeq, encoder
from shared.tokenizer import load_tokenizer
from tools.truncate_gguf import truncate_gguf

ROOT = Path(__file__).resolve().parents[1]
PROSE = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who had "
    "never seen the mountains. Every morning he rowed out past the lighthouse with his dog"
)
LAYERS = 4  # of SmolLM2's 30


@pytest.fixture(scope="module")
def ids(smollm2_path: Path) -> list[int]:
    return load_tokenizer(GGUFFile(smollm2_path).metadata).encode(PROSE, add_special=False)


@pytest.fixture(scope="module")
def truncated(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return truncate_gguf(smollm2_path, tmp_path_factory.mktemp("draft") / "smol-4l.gguf", LAYERS)


@pytest.fixture(scope="module")
def small(truncated: Path) -> DraftModel:
    return DraftModel(str(truncated))


def _greedy(draft: DraftModel, ids: list[int], n: int) -> list[int]:
    """The model's greedy continuation, each token from a fresh forward over the whole
    sequence in a pool of its own (no draft state, no cache reuse)."""
    mc = draft.model.cfg
    out: list[int] = []
    for _ in range(n):
        seq = ids + out
        blocks = list(range(-(-len(seq) // BLOCK_SIZE)))
        kv = KVPool(len(draft.model.layers), len(blocks), BLOCK_SIZE, mc.n_kv_heads,
                    mc.head_dim, torch.float32, "cpu")  # fmt: skip
        batch = ForwardBatch.build([SeqChunk(seq, 0, blocks)], BLOCK_SIZE, "cpu")
        out.append(int(draft.model(batch, kv).argmax(-1)[0]))
    return out


def test_the_target_as_its_own_draft_guesses_its_greedy_continuation(
    smollm2_path: Path, ids: list[int]
) -> None:
    draft = DraftModel(str(smollm2_path))
    assert draft.n_layers == 30
    want = _greedy(draft, ids, 12)
    (got,) = draft.propose([("a", ids, 8)])
    assert got == want[:8]
    # the sequence went on with 4 of the guesses: the K/V of the first 3 is kept (the 4th is
    # fed again, for its logits), the rest rolled back, and the next guesses go on from there
    ids2 = ids + want[:4]
    draft.cut("a", len(ids))  # the worker's copy grew from len(ids): nothing cut
    fed = draft.stats.fed
    (got2,) = draft.propose([("a", ids2, 6)])
    assert got2 == want[4:10]
    assert draft.stats.reused == 3 and draft.stats.fed - fed == 1 + 5
    draft.check_integrity()


def test_a_truncated_draft_proposes_at_most_k_and_batches_as_single_asks(
    small: DraftModel, truncated: Path, smollm2_path: Path, ids: list[int]
) -> None:
    assert small.n_layers == LAYERS
    assert check_vocab(truncated, smollm2_path) == 49152  # its vocabulary is the target's
    singles = [small.propose([(f"s{k}", ids[:n], k)])[0] for n, k in ((10, 5), (17, 1), (23, 3))]
    assert [len(g) for g in singles] == [5, 1, 3]
    assert all(0 <= t < 49152 for g in singles for t in g)
    assert singles[0] == _greedy(small, ids[:10], 5)
    batched = small.propose([(f"b{k}", ids[:n], k) for n, k in ((10, 5), (17, 1), (23, 3))])
    assert batched == singles
    assert small.propose([("z", ids, 0), ("e", [], 4)]) == [[], []]  # nothing asked
    assert "z" not in small and "e" not in small
    small.check_integrity()


def test_a_cut_copy_rolls_its_draft_back_to_a_fresh_sequences_proposal(
    small: DraftModel, ids: list[int]
) -> None:
    prompt, other = ids[:12], ids[12:20]
    fresh = small.propose([("fresh", prompt, 6)])[0]
    first = small.propose([("cut", prompt + other, 6)])[0]  # another continuation, fed
    assert small.cached("cut") == len(prompt) + len(other) + 5
    small.cut("cut", len(prompt))  # the worker resent from there: its copy changed
    assert small.cached("cut") == len(prompt)
    assert small.propose([("cut", prompt, 6)])[0] == fresh != first
    # cut to 0 (the copy replaced): a new sequence in the same blocks
    small.cut("cut", 0)
    assert small.propose([("cut", other, 6)])[0] == small.propose([("o", other, 6)])[0]
    small.check_integrity()


def test_a_tiny_pool_evicts_the_least_recently_asked(truncated: Path, ids: list[int]) -> None:
    draft = DraftModel(str(truncated), kv_blocks=4)  # 64 tokens
    a, b, c = ids[:20], ids[1:21], ids[2:22]  # 20 tokens and 3 fed guesses: 2 blocks each
    got_a = draft.propose([("a", a, 4)])[0]
    draft.propose([("b", b, 4)])
    assert (len(draft), draft.blocks.num_free, draft.stats.evicted) == (2, 0, 0)
    draft.propose([("c", c, 4)])  # no room: a, the least recently asked, goes
    assert "a" not in draft and "b" in draft and "c" in draft
    assert draft.stats.evicted == 1
    assert draft.propose([("a", a, 4)])[0] == got_a  # recomputed whole; b went
    assert "b" not in draft and draft.stats.evicted == 2
    # both in one ask need 4 blocks: neither evicts the other
    assert [len(g) for g in draft.propose([("a", a, 4), ("c", c, 4)])] == [4, 4]
    # longer than the pool: no draft, nothing else lost
    assert draft.propose([("long", ids * 3, 4)]) == [[]]
    assert draft.stats.too_long == 1 and "long" not in draft
    draft.forget("a")
    draft.forget("c")
    assert len(draft) == 0 and draft.blocks.num_free == 4
    draft.check_integrity()


def test_a_draft_of_another_vocabulary_is_refused_naming_both_files(
    smollm2_path: Path, gemma3_path: Path
) -> None:
    with pytest.raises(VocabMismatch) as e:
        check_vocab(gemma3_path, smollm2_path)
    msg = str(e.value)
    assert str(gemma3_path) in msg and str(smollm2_path) in msg and "token id 0 is" in msg
    # the spec service exits at start with it (before loading any weights) ...
    run = subprocess.run(
        [sys.executable, "-m", "services.spec", "--endpoint", "tcp://127.0.0.1:1",
         "--table-max-ngrams", "0", "--draft", str(gemma3_path), "--target", str(smollm2_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "token id 0 is" in run.stderr, run.stderr
    # ... and `skiff serve` before starting anything
    assert skiff(["serve", str(smollm2_path), "--spec", f"draft:{gemma3_path}"]) == 2


def test_the_service_asks_the_draft_where_prompt_lookup_finds_nothing(
    small: DraftModel, ids: list[int]
) -> None:
    seqs = LiveSequences(max_seqs=2, max_tokens=10_000, n_min=3, n_max=8)
    svc = SpecService(seqs, SpecStats(), max_draft=64, draft=small)
    enc = encoder()

    def ask(*items: SpecSeq) -> SpecDrafts:
        return svc.handle([b"w", enc.encode(SpecAsk(list(items)))])[1]

    repeat = ids[:6] + ids[:3]  # its last 3-gram occurred: prompt lookup answers
    got = ask(SpecSeq(1, 0, ids[:15], 4), SpecSeq(2, 0, repeat, 3))
    by_id = {d.seq_id: d for d in got.drafts}
    assert by_id[1].source == "draft" and by_id[1].at == 15 and len(by_id[1].tokens) == 4
    assert by_id[2].source == "prompt" and by_id[2].tokens == ids[3:6]
    assert (b"w", 1) in small and (b"w", 2) not in small  # the draft never ran for seq 2
    assert svc.stats.drafts["draft"] == 1 and svc.stats.draft_tokens["draft"] == 4
    assert "draft 1 (4 tokens)" in summary(svc.stats, seqs, None, small)
    metrics = {m.name: m for m in SpecCollector(svc.stats, seqs, None, small).collect()}
    steps = {s.name: s.value for s in metrics["skiff_spec_draft_step_seconds"].samples}
    assert steps["skiff_spec_draft_step_seconds_count"] == small.stats.forwards > 0
    assert steps["skiff_spec_draft_step_seconds_sum"] == small.stats.seconds > 0
    ask(SpecSeq(3, 0, ids[5:25], 2))  # a third sequence: the service's LRU evicts seq 1 ...
    assert (b"w", 1) not in small and (b"w", 3) in small  # ... and its draft state with it
    svc.handle([b"w", enc.encode(SpecEnd([3]))])
    assert (b"w", 3) not in small
    small.check_integrity()
