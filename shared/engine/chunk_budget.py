"""How many prompt tokens a step may take while other requests are decoding.

A long prompt's chunk lengthens every step it rides in, and so the gap between the tokens the
decoding streams receive. ``ChunkBudget`` keeps those steps near a target duration with a
feedback rule on the measured step times: a step over the target that carried a near-full
chunk shrinks the cap in proportion; a step well under it whose chunk filled the cap lets it
grow by a quarter. Steps without decodes are not capped (nobody waits on them) and do not
move it. The cap starts small so the first mixed step cannot be long.
"""

from __future__ import annotations

__all__ = ["ChunkBudget"]


class ChunkBudget:
    def __init__(
        self, target_ms: float, max_tokens: int, min_tokens: int = 32, start_tokens: int = 256
    ) -> None:
        if target_ms <= 0:
            raise ValueError(f"target_ms must be positive, got {target_ms}")
        self.target_ms = target_ms
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.cap = max(self.min_tokens, min(start_tokens, max_tokens))

    def observe(self, had_decodes: bool, prefill_tokens: int, seconds: float) -> None:
        """Account one finished step: whether it carried decodes, its prompt tokens, its time."""
        if not had_decodes or prefill_tokens == 0:
            return
        ms = seconds * 1e3
        if ms > self.target_ms and prefill_tokens * 2 >= self.cap:
            self.cap = max(self.min_tokens, int(self.cap * 0.9 * self.target_ms / ms))
        elif ms < 0.8 * self.target_ms and prefill_tokens >= self.cap:
            self.cap = min(self.max_tokens, self.cap + max(1, self.cap // 4))
