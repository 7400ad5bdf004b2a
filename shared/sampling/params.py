"""Per-request sampling parameters (OpenAI / vLLM semantics) and their validation.

This module owns the meaning of each knob and its legal range; the tensor work that
applies them lives in `sampler.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures this small are treated as greedy: dividing logits by them would only
# amplify float noise, and vLLM uses the same cut-off.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token for one request.

    temperature: 0 means greedy (argmax of the penalized logits).
    top_k: 0 or -1 disables it.
    top_p: nucleus mass in (0, 1]; 1 disables it.
    min_p: drop tokens whose probability is below min_p * p_max; 0 disables it.
    repetition_penalty: HF/llama.cpp style over prompt + output tokens
        (positive logit / penalty, non-positive logit * penalty); 1 disables it.
    presence_penalty, frequency_penalty: OpenAI style over output tokens only:
        logit -= presence * (count > 0) + frequency * count.
    seed: makes the random draws reproducible for this request.
    logprobs: None for no logprobs; k >= 0 returns the chosen token's logprob plus the
        top-k alternatives.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first out-of-range field; return self when valid."""
        # Comparisons are written so that NaN fails them.
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `top_k=True` is a caller bug, not a value.
    return isinstance(value, int) and not isinstance(value, bool)
