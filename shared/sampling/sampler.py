"""Batched next-token sampling on the logits' device.

This module owns turning one step's [B, V] logits into token ids (plus logprobs) for a
batch of requests with heterogeneous `SamplingParams`. Pipeline per step:
penalties -> logprobs -> temperature -> top-k -> top-p -> min-p -> sample.

Reported logprobs are log_softmax (float32) of the *penalized* logits, before
temperature and filtering: they describe the model's (penalized) belief rather than
the sampling distribution, so greedy and sampled requests report comparable numbers
and a token removed by top-k/top-p still has a finite logprob.

Nothing here waits on the device: decisions use the Python-side params, host->device
copies of the small per-step inputs are non-blocking, and all results stay on the
device so the caller pays one transfer per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from shared.kernels.argmax import argmax_rows
from shared.staging import to_device

from .params import SamplingParams

_U64 = (1 << 64) - 1


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, the chosen tokens' (if any row asked)
    top_ids: torch.Tensor | None = None  # [B, K] int64, K = max logprobs asked in batch
    top_logprobs: torch.Tensor | None = None  # [B, K] float32, sorted descending
    # [B] int64 in pinned host memory: token_ids stored there by the argmax itself (sample's
    # host_ids), valid once the stream has passed it; None: not stored (a caller copies them)
    host_ids: torch.Tensor | None = None
    # [B] bool, verification steps (verify.py): whether each row's token is its draft's
    accepted: torch.Tensor | None = None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """Per-request RNG; create once per request and pass it every step."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    # OpenAI seeds may be negative or wider than 64 bits; manual_seed wants [0, 2**64).
    gen.manual_seed(seed & _U64)
    return gen


def _count_ids(
    id_lists: list[list[int]], batch: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """[B, V] float32 occurrence counts built with one scatter_add."""
    lengths = [len(ids) for ids in id_lists]
    total = sum(lengths)
    # Column V is a dump bin: out-of-range ids (e.g. tokenizer ids past the logits'
    # vocab) land there instead of tripping a device-side assert.
    counts = torch.zeros(batch * (vocab + 1), dtype=torch.float32, device=device)
    if total:
        # fromiter is ~4x faster than torch.tensor(list) on long prompts.
        flat = np.fromiter(chain.from_iterable(id_lists), dtype=np.int64, count=total)
        cols = to_device(torch.from_numpy(flat), device)
        cols = torch.where((cols < 0) | (cols >= vocab), vocab, cols)
        rows = torch.repeat_interleave(
            torch.arange(batch, device=device),
            to_device(torch.tensor(lengths), device),
            output_size=total,
        )
        counts.scatter_add_(0, rows * (vocab + 1) + cols, torch.ones_like(cols, dtype=counts.dtype))
    return counts.view(batch, vocab + 1)[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    """Return float32 penalized logits (a new tensor; the input is not modified)."""
    batch, vocab = logits.shape
    device = logits.device
    x = logits.float()
    rep_rows = [p.repetition_penalty != 1.0 for p in params]
    pen_rows = [p.has_penalties for p in params]
    if not any(pen_rows):
        return x.clone()
    out_counts = _count_ids(
        [ids if need else [] for ids, need in zip(output_ids, pen_rows, strict=True)],
        batch,
        vocab,
        device,
    )
    coef = torch.tensor(
        [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params],
        dtype=torch.float32,
    )
    coef = to_device(coef, device)
    rep, presence, frequency = coef[:, 0:1], coef[:, 1:2], coef[:, 2:3]
    if any(rep_rows):
        prompt_counts = _count_ids(
            [ids if need else [] for ids, need in zip(prompt_ids, rep_rows, strict=True)],
            batch,
            vocab,
            device,
        )
        seen = (out_counts + prompt_counts) > 0
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - presence * (out_counts > 0) - frequency * out_counts


class Sampler:
    """Per-request state (the RNG) is owned by the caller. The sampler keeps only the greedy
    argmax's counters (argmax_rows' counts: zeros between launches), one buffer a device, so
    one sampler serves one stream of steps."""

    def __init__(self) -> None:
        self._counts: dict[torch.device, torch.Tensor] = {}

    def argmax(self, x: torch.Tensor, host: torch.Tensor | None = None) -> torch.Tensor:
        """torch.argmax over the last dim (the first index of the maximum); one launch on a GPU,
        which with `host` (pinned [B] int64) also stores the picks there."""
        if not x.is_cuda:
            return x.argmax(dim=-1)
        counts = self._counts.get(x.device)
        if counts is None or counts.numel() < x.shape[0]:
            counts = torch.zeros(max(64, x.shape[0]), dtype=torch.int32, device=x.device)
            self._counts[x.device] = counts
        return argmax_rows(x, counts, host)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        host_ids: torch.Tensor | None = None,
    ) -> SampleOutput:
        """host_ids: pinned [B] int64 the greedy picks are stored into by the argmax's own
        launch, on a GPU when every row is greedy (then SampleOutput.host_ids is it)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        batch, vocab = logits.shape
        for name, seq in (
            ("params", params),
            ("prompt_ids", prompt_ids),
            ("output_ids", output_ids),
            ("generators", generators),
        ):
            if len(seq) != batch:
                raise ValueError(f"len({name})={len(seq)} does not match batch size {batch}")

        if any(p.has_penalties for p in params):
            x = apply_penalties(logits, params, prompt_ids, output_ids)
        else:
            x = logits
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows or not x.is_cuda:
            host_ids = None
        # the first maximum, so greedy ties go to the lowest id; in the logits' dtype (its
        # float32 copy, below, is made only for what needs it)
        tokens = self.argmax(x, host_ids)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if random_rows or asked:
            x = x.float()
        if random_rows:
            if len(random_rows) == batch:
                tokens = self._sample_random(x, params, generators)
            else:
                idx = to_device(torch.tensor(random_rows, dtype=torch.int64), x.device)
                sub = self._sample_random(
                    x.index_select(0, idx),
                    [params[i] for i in random_rows],
                    [generators[i] for i in random_rows],
                )
                tokens = tokens.index_put((idx,), sub)

        if not asked:  # a [B, V] reduction (two launches, ~70 us at batch 1) nobody reads
            return SampleOutput(token_ids=tokens, host_ids=host_ids)
        # logit - logsumexp == log_softmax, without materializing a [B, V] tensor.
        lse = torch.logsumexp(x, dim=-1)
        chosen = x.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
        top_vals, top_ids = x.topk(min(max(asked), vocab), dim=-1)
        return SampleOutput(
            token_ids=tokens,
            logprobs=chosen,
            top_ids=top_ids,
            top_logprobs=top_vals - lse.unsqueeze(1),
            host_ids=host_ids,
        )

    @staticmethod
    def _sample_random(
        x: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Sample rows that are all non-greedy; x is float32 penalized logits."""
        return race_draw(filtered_probs(x, params), generators)


def filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each non-greedy row samples from: softmax of the penalized float32
    logits x over temperature, after top-k, top-p and min-p."""
    batch, vocab = x.shape
    device = x.device
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    any_top_k = any(k < vocab for k in top_k)
    any_top_p = any(p.top_p < 1.0 for p in params)
    any_min_p = any(p.min_p > 0.0 for p in params)
    cols = torch.tensor(
        [
            [
                p.temperature,
                float(k),
                # A disabled top-p must remove nothing even if cumsum rounds above 1.
                p.top_p if p.top_p < 1.0 else 2.0,
                math.log(p.min_p) if p.min_p > 0.0 else -math.inf,
            ]
            for p, k in zip(params, top_k, strict=True)
        ],
        dtype=torch.float32,
    )
    cols = to_device(cols, device)
    temp, k_col, top_p, log_min_p = (cols[:, i : i + 1] for i in range(4))
    k_col = k_col.long()

    x = x / temp
    neg_inf = -math.inf
    if any_top_p:
        # One stable sort serves both top-k and top-p; stability keeps ties ordered by id.
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        pos = torch.arange(vocab, device=device)
        remove = pos >= k_col
        probs = sorted_x.masked_fill(remove, neg_inf).softmax(dim=-1)
        # Drop a token once the mass strictly before it already exceeds top_p;
        # the most likely token always survives.
        remove |= (probs.cumsum(dim=-1) - probs) > top_p
        x = x.masked_fill(torch.empty_like(remove).scatter_(1, order, remove), neg_inf)
    elif any_top_k:
        k_max = max(k for k in top_k if k < vocab)
        _, top_idx = x.topk(k_max, dim=-1)
        keep_sorted = torch.arange(k_max, device=device) < k_col
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, top_idx, keep_sorted)
        # Rows with top-k off see only k_max candidates above; they must keep all.
        keep |= k_col >= vocab
        x = x.masked_fill(~keep, neg_inf)
    if any_min_p:
        # p < min_p * p_max  <=>  logit - max_logit < log(min_p)
        x_max = x.max(dim=-1, keepdim=True).values
        x = x.masked_fill(x - x_max < log_min_p, neg_inf)
    return x.softmax(dim=-1)


def race_draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row drawn from probs [B, V] (rows need not be normalized).

    Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p, needs no
    cumsum/searchsorted, and lets each seeded row draw from its own generator."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    # A zero draw would turn 0/0 into NaN for filtered tokens.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
