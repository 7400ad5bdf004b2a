"""Tests for shared.sampling: params validation, penalties, filtering, seeding, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from shared.sampling import SampleOutput, Sampler, SamplingParams, make_generator
from shared.sampling.sampler import apply_penalties


def _sample(logits, params, prompt=None, output=None, gens=None) -> SampleOutput:
    b = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * b
    return Sampler().sample(
        logits,
        params,
        prompt if prompt is not None else [[] for _ in range(b)],
        output if output is not None else [[] for _ in range(b)],
        gens if gens is not None else [None] * b,
    )


def _draws(probs: list[float], params: SamplingParams, n: int = 4000, perm_seed: int = 0):
    """Sample n times from a distribution with known probabilities, ids shuffled."""
    v = len(probs)
    perm = torch.randperm(v, generator=torch.Generator().manual_seed(perm_seed))
    logits = torch.empty(v)
    logits[perm] = torch.tensor(probs).log()
    torch.manual_seed(1)
    out = _sample(logits.expand(n, v).contiguous(), params)
    # Map sampled ids back to the rank in `probs`.
    rank_of_id = torch.empty(v, dtype=torch.long)
    rank_of_id[perm] = torch.arange(v)
    return set(rank_of_id[out.token_ids].tolist())


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_dtypes():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = _sample(logits.to(dtype), SamplingParams(temperature=0.0))
        assert out.token_ids.dtype == torch.int64
        assert torch.equal(out.token_ids, logits.to(dtype).float().argmax(-1))
        # no row asked for logprobs: none are computed
        assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
        asked = _sample(logits.to(dtype), SamplingParams(temperature=0.0, logprobs=0))
        assert asked.logprobs.dtype == torch.float32 and asked.top_ids.shape == (16, 0)


def test_greedy_ties_go_to_lowest_id():
    logits = torch.zeros(4, 10)
    logits[:, [7, 3, 9]] = 5.0
    for _ in range(3):
        out = _sample(logits, SamplingParams(temperature=0.0))
        assert out.token_ids.tolist() == [3, 3, 3, 3]


def test_greedy_rows_in_mixed_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.9)] * 3
    out = _sample(logits, params)
    assert out.token_ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()


# --------------------------------------------------------------------------- seeding


def _logit_steps(steps: int = 50, vocab: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    # Flat-ish so that different seeds diverge quickly.
    return [0.3 * torch.randn(vocab, generator=g) for _ in range(steps)]


def _run_seeded(seed: int, params: SamplingParams, neighbours: int = 0) -> list[int]:
    """Token sequence of a seeded row (row 0), optionally batched with unrelated rows."""
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=7),
        SamplingParams(temperature=1.2, top_p=0.5, min_p=0.1),
        SamplingParams(presence_penalty=1.0, repetition_penalty=1.3),
    ][:neighbours]
    batch = [params, *others]
    gens = [make_generator(seed, "cpu"), *(make_generator(p.seed, "cpu") for p in others)]
    g_other = torch.Generator().manual_seed(99)
    seq: list[int] = []
    for step in _logit_steps():
        logits = torch.cat([step[None], torch.randn(neighbours, step.numel(), generator=g_other)])
        out = _sample(logits, batch, gens=gens, output=[[1, 2]] * len(batch))
        seq.append(out.token_ids[0].item())
    return seq


@pytest.mark.parametrize(
    "params",
    [SamplingParams(seed=1234), SamplingParams(seed=1234, temperature=0.9, top_p=0.95, top_k=20)],
)
def test_same_seed_same_sequence_different_seed_differs(params):
    a = _run_seeded(1234, params)
    b = _run_seeded(1234, params)
    c = _run_seeded(4321, params)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # really sampling, not stuck on argmax


def test_seeded_row_independent_of_batch_neighbours():
    params = SamplingParams(seed=1234, temperature=0.9)
    alone = _run_seeded(1234, params)
    for n in (1, 4):
        torch.manual_seed(n)  # the unseeded default RNG must not matter either
        assert _run_seeded(1234, params, neighbours=n) == alone


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(-5, "cpu"), make_generator(-5, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    big = make_generator(2**70 + 3, "cpu")
    assert big is not None


# --------------------------------------------------------------------------- filters


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(5))
    out = _sample(logits, SamplingParams(temperature=1.0, top_k=1))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_only_top_ids_appear():
    probs = [0.05] * 20  # flat: without top-k all 20 would show up
    probs = [p + 0.001 * (20 - i) for i, p in enumerate(probs)]
    assert _draws(probs, SamplingParams(top_k=5)) == set(range(5))
    # Mixed with a row that has top-k off: that row must keep the full vocab.
    logits = torch.tensor(probs).log().expand(2000, 20).contiguous()
    params = [SamplingParams(top_k=3), SamplingParams(top_k=0)] * 1000
    out = _sample(logits, params)
    assert set(out.token_ids[0::2].tolist()) == {0, 1, 2}
    assert len(set(out.token_ids[1::2].tolist())) == 20


def test_top_p_only_nucleus_appears():
    probs = [0.5, 0.3, 0.1, 0.05, 0.05]
    assert _draws(probs, SamplingParams(top_p=0.75)) == {0, 1}
    assert _draws(probs, SamplingParams(top_p=0.85)) == {0, 1, 2}
    assert _draws(probs, SamplingParams(top_p=0.3)) == {0}
    assert _draws(probs, SamplingParams(top_p=1.0)) == {0, 1, 2, 3, 4}
    assert _draws(probs, SamplingParams(top_p=0.95, top_k=2)) == {0, 1}


def test_min_p_drops_unlikely_tokens():
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    # threshold 0.3 * 0.4 = 0.12: ranks 3 and 4 must never appear
    assert _draws(probs, SamplingParams(min_p=0.3)) == {0, 1, 2}
    assert _draws(probs, SamplingParams(min_p=0.2)) == {0, 1, 2, 3}


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    temp = 0.6
    n = 20000
    torch.manual_seed(0)
    out = _sample(logits.expand(n, 8).contiguous(), SamplingParams(temperature=temp))
    freq = torch.bincount(out.token_ids, minlength=8).float() / n
    expected = torch.softmax(logits / temp, -1)
    assert (freq - expected).abs().max().item() < 0.015
    # Sanity: the tolerance is tight enough to notice a missing temperature.
    assert (torch.softmax(logits, -1) - expected).abs().max().item() > 0.05


# --------------------------------------------------------------------------- penalties


def _reference_penalties(logits, p: SamplingParams, prompt, output):
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in seen:
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        out[t] -= p.presence_penalty + p.frequency_penalty * c
    return out


def test_penalties_match_reference():
    logits = torch.tensor(
        [
            [1.5, -2.0, 0.7, -0.3, 0.0, 3.0, -1.0, 2.0],
            [1.5, -2.0, 0.7, -0.3, 0.0, 3.0, -1.0, 2.0],
            [0.2, 0.4, -0.6, 0.8, -1.0, 1.2, -1.4, 1.6],
            [0.2, 0.4, -0.6, 0.8, -1.0, 1.2, -1.4, 1.6],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalties: unchanged even though ids are given
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.4),
        SamplingParams(frequency_penalty=1.5),
    ]
    prompt = [[1, 2, 2, 5], [0, 1], [3, 4, 4], [6, 6, 7]]
    output = [[2, 3, 3, 3, 1, 40], [5, 5], [4, 6, 6, 0], [7, 7, 7, 0]]  # 40 is out of range
    got = apply_penalties(logits, params, prompt, output)
    assert got.dtype == torch.float32
    for i, p in enumerate(params):
        ref = _reference_penalties(
            logits[i].tolist(), p, prompt[i], [t for t in output[i] if t < 8]
        )
        assert got[i].tolist() == pytest.approx(ref, abs=1e-6), i
    assert torch.equal(got[1], logits[1])
    # Input untouched.
    assert logits[0, 5].item() == 3.0


def test_penalties_steer_sampling():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    out = _sample(logits, SamplingParams(temperature=0.0, frequency_penalty=0.1), output=[[0, 0]])
    assert out.token_ids.item() == 1


# --------------------------------------------------------------------------- logprobs


def test_logprobs_match_log_softmax_of_penalized_logits():
    b, v = 6, 40
    logits = torch.randn(b, v, generator=torch.Generator().manual_seed(11)) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, logprobs=5, presence_penalty=0.5, seed=3),
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=0.0, logprobs=0, frequency_penalty=0.3),
        SamplingParams(temperature=1.3, top_p=0.5, logprobs=1),
        SamplingParams(temperature=0.5, min_p=0.2, logprobs=5),
    ]
    prompt = [[1, 2, 3]] * b
    output = [[4, 4, 5], [0, 1], [], [7, 7, 7], [2], [3, 9]]
    gens = [make_generator(p.seed, "cpu") for p in params]
    out = _sample(logits, params, prompt, output, gens)
    ref = torch.log_softmax(apply_penalties(logits, params, prompt, output), -1)
    chosen_ref = ref.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen_ref)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (b, 5) and out.top_logprobs.dtype == torch.float32
    top_ref = torch.topk(ref, 5, dim=-1)
    assert torch.equal(out.top_ids, top_ref.indices)
    torch.testing.assert_close(out.top_logprobs, top_ref.values)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    # The greedy row's chosen token is the best penalized one.
    assert out.token_ids[0].item() == out.top_ids[0, 0].item()


# --------------------------------------------------------------------------- validation


def test_defaults_valid_and_greedy_property():
    assert SamplingParams().validate() == SamplingParams()
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    SamplingParams(top_k=-1, top_p=0.01, min_p=1.0, logprobs=20, presence_penalty=-2).validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": math.nan},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"top_k": -2},
        {"top_k": 1.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"presence_penalty": 2.5},
        {"presence_penalty": -2.1},
        {"frequency_penalty": 3.0},
        {"frequency_penalty": -2.5},
        {"logprobs": -1},
        {"logprobs": 21},
        {"seed": "7"},
    ],
)
def test_validate_rejects(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs).validate()


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()] * 2, [[], []], [[], []], [None])


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_mixed_batch():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    steps = [torch.randn(4, 32000, device=dev, generator=g).bfloat16() for _ in range(20)]
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.9, top_p=0.9, seed=77, logprobs=2),
        SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.1, seed=5),
        SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5),
    ]

    def run() -> list[list[int]]:
        gens = [make_generator(p.seed, dev) for p in params]
        seqs: list[list[int]] = [[] for _ in params]
        for logits in steps:
            out = _sample(logits, params, [[1, 2, 3]] * 4, seqs, gens)
            assert out.token_ids.device.type == "cuda"
            assert out.top_ids is not None and out.top_ids.shape == (4, 5)
            assert out.token_ids[0].item() == logits[0].float().argmax().item()
            for seq, tok in zip(seqs, out.token_ids.tolist(), strict=True):
                seq.append(tok)
        return seqs

    a, b = run(), run()
    assert a[1] == b[1] and a[2] == b[2] and a[0] == b[0]
