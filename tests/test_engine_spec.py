"""Speculative verification in the engine on tiny synthetic models (CPU): drafts never change
greedy output whatever they propose, rejected drafts leave the pool and prefix cache as plain
decoding leaves them, logprobs of kept tokens match plain decoding's, and sampled tokens keep
plain decoding's distribution (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.engine import LLMEngine, SeqStatus, Sequence, TokenEvent
from shared.engine.draft_length import DraftLength
from shared.loader import GGUFFile
from shared.model import load_model
from shared.model.causal_lm import CausalLM
from shared.sampling import Sampler, SamplingParams, make_generator
from shared.sampling.verify import verify
from tests.test_engine import GREEDY, GREEDY_TOP, SPECS, make_engine, prompt, run_all, tokens_by_seq
from tools.synthetic_gguf import write_synthetic_gguf


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only spin (test_engine.py)
    yield
    torch.set_num_threads(threads)


def _load(d, arch: str) -> CausalLM:
    path = write_synthetic_gguf(d / f"{arch}.gguf", SPECS[arch])
    return load_model(GGUFFile(path, cache_dir=d / "cache"), "cpu")


@pytest.fixture(scope="module", params=list(SPECS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    return _load(tmp_path_factory.mktemp("spec-models"), request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    return _load(tmp_path_factory.mktemp("spec-llama"), "llama")


def run_speculating(engine: LLMEngine, propose, max_steps: int = 4000) -> list[TokenEvent]:
    """run_all, with each decoding sequence given propose(seq)'s draft before every step (as
    the worker gives the spec service's), its integrity checked after every step."""
    events: list[TokenEvent] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return events
        for seq in engine.running:
            if seq.output_ids and seq.spec is not None and seq.spec.k:
                seq.draft = propose(seq)[: seq.spec.k]
                seq.draft_source = "test"
        events += engine.step()
        engine.check_integrity()
    raise AssertionError("the engine made no progress")


def oracle(reference: dict[int, list[int]], wrong_every: int = 0, seed: int = 0):
    """Drafts from the known greedy continuation, every wrong_every-th token replaced by a wrong
    one (0: all right)."""
    rng = np.random.default_rng(seed)

    def propose(seq: Sequence) -> list[int]:
        ref = reference[seq.seq_id]
        draft = list(ref[len(seq.output_ids) : len(seq.output_ids) + 8])
        if wrong_every:
            for i in range(len(draft)):
                if rng.integers(wrong_every) == 0:
                    draft[i] = (draft[i] + 1 + int(rng.integers(300))) % 320
        return draft

    return propose


def _seqs(n: int, max_tokens: int, params: SamplingParams = GREEDY, spec: bool = True):
    return [
        Sequence(
            i, prompt(5 + 3 * i, seed=i), params, max_tokens,
            spec=DraftLength(8) if spec else None,
        )
        for i in range(n)
    ]  # fmt: skip


def _plain(model: CausalLM, n: int, max_tokens: int, params=GREEDY) -> list[TokenEvent]:
    engine = make_engine(model)
    for seq in _seqs(n, max_tokens, params, spec=False):
        engine.add(seq)
    return run_all(engine)


@pytest.mark.parametrize("wrong_every", [0, 3, 1])
def test_greedy_unchanged_by_drafts(model: CausalLM, wrong_every: int) -> None:
    want = tokens_by_seq(_plain(model, 6, 24))
    engine = make_engine(model)
    for seq in _seqs(6, 24):
        engine.add(seq)
    got = tokens_by_seq(run_speculating(engine, oracle(want, wrong_every)))
    assert got == want
    stats = engine.spec_stats
    assert stats["steps"] > 0 and stats["drafted:test"] > 0
    if wrong_every == 0:  # right drafts are all kept: far fewer steps than tokens
        assert stats["accepted:test"] == stats["drafted:test"]
        assert stats["steps"] * 2 < sum(len(v) for v in want.values())
    if wrong_every == 1:
        assert stats["accepted:test"] < stats["drafted:test"] / 2


def test_logprobs_of_kept_tokens_match_plain_decoding(llama: CausalLM) -> None:
    want = _plain(llama, 3, 16, GREEDY_TOP)
    engine = make_engine(llama)
    for seq in _seqs(3, 16, GREEDY_TOP):
        engine.add(seq)
    got = run_speculating(engine, oracle(tokens_by_seq(want), wrong_every=4))
    key = lambda e: (e.seq_id, e.token_id)  # noqa: E731
    got_by, want_by = {}, {}
    for evs, by in ((got, got_by), (want, want_by)):
        for e in evs:
            by.setdefault(e.seq_id, []).append(e)
    for sid, evs in want_by.items():
        assert [key(e) for e in got_by[sid]] == [key(e) for e in evs]
        for g, w in zip(got_by[sid], evs, strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert g.finish_reason == w.finish_reason


def test_rollback_under_pressure_with_cancels(llama: CausalLM) -> None:
    """A pool too small for every sequence's drafts, preemption, cancels mid-draft and stop ids:
    the pool's accounting stays clean (check_integrity each step), the survivors' outputs are
    plain decoding's, and every block comes back."""
    want = tokens_by_seq(_plain(llama, 12, 30))
    engine = make_engine(llama, num_blocks=40, block_size=4)
    seqs = _seqs(12, 30)
    for seq in seqs:
        engine.add(seq)
    propose = oracle(want, wrong_every=3, seed=5)
    events: list[TokenEvent] = []
    step = 0
    while engine.has_work():
        for seq in engine.running:
            if seq.output_ids and seq.spec.k:
                seq.draft = propose(seq)[: seq.spec.k]
        events += engine.step()
        engine.check_integrity()
        step += 1
        if step in (7, 19):  # cancel one that is decoding
            victim = next(s for s in engine.running if s.output_ids)
            assert engine.abort(victim.seq_id)
        assert step < 4000
    got = tokens_by_seq(events)
    finished = [s for s in seqs if s.finish_reason == "length"]
    assert len(finished) >= 8
    for s in finished:
        assert got[s.seq_id] == want[s.seq_id]
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert sum(s.num_preemptions for s in seqs) > 0, "the pool was meant to be too small"
    assert all(s.status is SeqStatus.FINISHED for s in seqs)


def test_max_tokens_and_stop_inside_a_draft(llama: CausalLM) -> None:
    ref = tokens_by_seq(_plain(llama, 1, 20))[0]
    stop = ref[9]
    engine = make_engine(llama)
    seq = Sequence(0, prompt(5, seed=0), GREEDY, 20, frozenset({stop}), spec=DraftLength(8))
    engine.add(seq)
    got = [e.token_id for e in run_speculating(engine, oracle({0: ref}))]
    assert got == ref[: ref.index(stop) + 1] and seq.finish_reason == "stop"
    engine = make_engine(llama)
    seq = Sequence(0, prompt(5, seed=0), GREEDY, 7, spec=DraftLength(8))
    engine.add(seq)
    got = [e.token_id for e in run_speculating(engine, oracle({0: ref}))]
    assert got == ref[:7] and seq.finish_reason == "length"


# -- the sampled distribution ---------------------------------------------------------------------


def _chi2(a: np.ndarray, b: np.ndarray, vocab: int) -> float:
    """p-value that samples a and b come from one distribution (a 2 x K contingency test over
    the tokens either drew at least 5 times; the rest pooled)."""
    ca, cb = np.bincount(a, minlength=vocab), np.bincount(b, minlength=vocab)
    big = (ca + cb) >= 10
    ca = np.append(ca[big], ca[~big].sum())
    cb = np.append(cb[big], cb[~big].sum())
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = ((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum()
    dof = torch.tensor(float(len(total) - 1))
    return float(torch.special.gammaincc(dof / 2, torch.tensor(float(stat)) / 2))  # chi2.sf


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.2, min_p=0.02, presence_penalty=0.8),
    ],
    ids=["t1", "topk-topp", "minp-penalty"],
)
def test_verify_keeps_the_row_distribution(params: SamplingParams) -> None:
    """One row, one draft: the kept token (the draft when accepted, else the residual's draw)
    is distributed as plain sampling's, whichever token is proposed (likely, unlikely, filtered)."""
    torch.manual_seed(0)
    vocab, n = 40, 6000
    logits = torch.randn(1, vocab) * 2
    sampler = Sampler()
    plain = sampler.sample(logits.expand(n, vocab), [params] * n, [[1]] * n, [[3]] * n, [None] * n)
    for draft in (int(logits.argmax()), int(logits.argmin()), 7):
        out = verify(
            sampler, logits.expand(n, vocab), [params] * n, [[1]] * n, [[3]] * n, [None] * n,
            [draft] * n,
        )  # fmt: skip
        p = _chi2(out.token_ids.numpy(), plain.token_ids.numpy(), vocab)
        assert p > 1e-3, (draft, p)
        assert bool((out.accepted == (out.token_ids == draft)).all())


def test_sampled_sequences_keep_their_distribution(llama: CausalLM) -> None:
    """2,000 sampled continuations of one prompt, 4 tokens each, with drafts (half of them the
    greedy continuation, half noise) and without: each position's tokens agree (chi-square)."""
    params = SamplingParams(temperature=0.9, top_p=0.95)
    ids, n, max_tokens = prompt(6, seed=2), 2000, 4
    greedy = tokens_by_seq(_plain(llama, 1, max_tokens))[0]
    rng = np.random.default_rng(1)

    def runs(spec: bool) -> np.ndarray:
        out = []
        for base in range(0, n, 250):
            engine = make_engine(llama, num_blocks=400, max_batch_tokens=512)
            engine.scheduler.max_seqs = 250
            for i in range(base, base + 250):
                gen = make_generator(10_000 * spec + i, "cpu")
                engine.add(
                    Sequence(i, ids, params, max_tokens, generator=gen,
                             spec=DraftLength(4) if spec else None)
                )  # fmt: skip

            def propose(seq: Sequence) -> list[int]:
                if rng.integers(2):
                    return greedy[len(seq.output_ids) :]
                return rng.integers(0, 320, 4).tolist()

            by = tokens_by_seq(run_speculating(engine, propose) if spec else run_all(engine))
            out += [by[i] for i in range(base, base + 250)]
        return np.array(out)

    plain, speculated = runs(False), runs(True)
    for pos in range(1, max_tokens):  # position 0 comes from the prompt's step: no draft
        p = _chi2(speculated[:, pos], plain[:, pos], 320)
        assert p > 1e-3, (pos, p)
