"""Verifying proposed tokens: one step's logits rows of drafted positions, each row's token
decided so that the tokens a sequence keeps are distributed exactly as plain decoding's.

A sequence that carries d draft tokens into a step gets d + 1 logits rows: row j is the
distribution of the token after its j-th new token (row 0: after its last sampled token). Row j
is given draft j (the last row none, -1), and comes out with a token and whether that token
*is* the draft ("accepted"). The engine keeps rows up to and including the first one not
accepted: accepted drafts, then one token of the model's own (a correction, or the bonus after
a fully accepted draft).

Greedy rows: the token is the argmax, accepted when it equals the draft, so the kept tokens are
those plain greedy decoding picks. Sampled rows (rejection sampling, Leviathan et al. 2023, with
a proposal that is one token for sure, as n-gram and greedy-draft proposals are): the draft t
is accepted with probability p(t); otherwise the token is drawn from p with t removed and
renormalised (max(0, p - q) for q the point mass at t). A kept token is then distributed as p,
whatever the drafts were. p is the row's sampling distribution after penalties (which see the
drafts before the row as output), temperature, top-k, top-p and min-p; each seeded row draws its
uniform and its residual from the request's generator.
"""

from __future__ import annotations

import torch

from shared.staging import to_device

from .params import SamplingParams
from .sampler import SampleOutput, Sampler, apply_penalties, filtered_probs, race_draw


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    generators: list[torch.Generator | None],
    drafts: list[int],
) -> SampleOutput:
    """Per row (lists aligned with logits' rows; output_ids of row j include the drafts
    before it): its token, whether it is the row's draft, and the logprobs asked."""
    vocab = logits.shape[1]
    if not len(params) == len(prompt_ids) == len(output_ids) == len(generators) == len(drafts):
        raise ValueError("verify: one params, prompt, output, generator and draft per row")
    x = logits
    if any(p.has_penalties for p in params):
        x = apply_penalties(logits, params, prompt_ids, output_ids)
    draft = to_device(torch.tensor(drafts, dtype=torch.int64), x.device)
    tokens = sampler.argmax(x)
    accepted = tokens == draft
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if random_rows or asked:
        x = x.float()
    if random_rows:
        idx = to_device(torch.tensor(random_rows, dtype=torch.int64), x.device)
        gens = [generators[i] for i in random_rows]
        probs = filtered_probs(x.index_select(0, idx), [params[i] for i in random_rows])
        d = draft.index_select(0, idx)
        has = d >= 0
        col = d.clamp(min=0).unsqueeze(1)
        p_draft = probs.gather(1, col).squeeze(1)
        u = _uniform(len(random_rows), gens, x.device)
        keep = has & (u < p_draft)
        residual = torch.where(has.unsqueeze(1), probs.scatter(1, col, 0.0), probs)
        drawn = race_draw(residual, gens)
        tokens = tokens.index_put((idx,), torch.where(keep, d, drawn))
        accepted = accepted.index_put((idx,), keep)
    if not asked:
        return SampleOutput(token_ids=tokens, accepted=accepted)
    lse = torch.logsumexp(x, dim=-1)
    chosen = x.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
    top_vals, top_ids = x.topk(min(max(asked), vocab), dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_vals - lse.unsqueeze(1), accepted=accepted)


def _uniform(n: int, generators: list[torch.Generator | None], device: torch.device):
    """[n] uniforms in [0, 1): each seeded row's from its own generator."""
    u = torch.empty(n, dtype=torch.float32, device=device)
    if any(g is None for g in generators):
        u.uniform_()
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row : row + 1].uniform_(generator=gen)
    return u
