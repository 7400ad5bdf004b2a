"""A request as the engine tracks it: tokens, sampling state, KV blocks and how far it got."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shared.engine.draft_length import DraftLength
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from shared.grammar import Constraint


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    num_preemptions: int = 0
    swapped: bool = False  # preempted, not yet offered to the KV tiers (Scheduler.on_resume)
    # overlapped steps: a token sampled by the step still running on the device, not yet in
    # output_ids (its id is taken on the device by the next step), and its row in that step
    num_inflight: int = 0
    inflight_row: int = -1
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    # speculation: how many tokens to ask the proposers for (None: it does not speculate); a
    # proposal of what follows its num_tokens tokens, for the next step; of those, the ones
    # the scheduled step verifies
    spec: DraftLength | None = None
    draft: list[int] = field(default_factory=list)
    draft_source: str = ""
    num_verifying: int = 0
    domain: str = ""  # the spec service's domain n-gram table its drafts may come from
    # structured output: the grammar its tokens must match (masks each step's logits)
    constraint: Constraint | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step needs one token); an
        in-flight token reads as 0 (the runner fills its id in on the device)."""
        known = len(self.prompt_ids) + len(self.output_ids)
        if end > known:
            return self.token_slice(start, known) + [0] * (end - max(start, known))
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def sampling_done(self) -> bool:
        """max_tokens reached, counting a token still in flight."""
        return len(self.output_ids) + self.num_inflight >= self.max_tokens

    @property
    def num_pending(self) -> int:
        """Tokens not yet run through the model (a prompt's rest, or the last sampled token)."""
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class TokenEvent:
    """One new token of one sequence from one engine step."""

    seq_id: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None
    finish_reason: str | None  # "stop", "length" or None while running
    cached_tokens: int = 0  # on the first token: prompt tokens the prefix cache supplied
