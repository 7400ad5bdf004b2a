"""How many prompt tokens a step may take while other requests are decoding.

A long prompt's chunk lengthens every step it rides in, and so the gap between the tokens the
decoding streams receive. ``ChunkBudget`` keeps those steps near a target duration with a
feedback rule on the measured step times: a step over the allowed time that carried a
near-full chunk shrinks the cap in proportion; a step well under it whose chunk filled the cap
lets it grow by a quarter. Steps without decodes are not capped (nobody waits on them) and do
not move it. The cap starts small so the first mixed step cannot be long.

The allowed time is the target, or twice the time the decodes take alone when that is longer
(a running average of the steps that carried decodes and no prompt): a target the decodes
alone miss cannot be met by shrinking the chunk, and chasing it would starve the prompt (on
the H200 a 20 ms target with 17-24 ms decode steps cut chunks to 32 tokens and a 32k prompt's
first token to 41 s). So the prompt always gets about half of such a step.
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
        self.decode_ms = 0.0  # running average of decode-only steps (0: none seen yet)

    @property
    def allowed_ms(self) -> float:
        return max(self.target_ms, 2.0 * self.decode_ms)

    def observe(self, had_decodes: bool, prefill_tokens: int, seconds: float) -> None:
        """Account one finished step: whether it carried decodes, its prompt tokens, its time."""
        if not had_decodes:
            return
        ms = seconds * 1e3
        if prefill_tokens == 0:
            self.decode_ms = ms if self.decode_ms == 0.0 else 0.8 * self.decode_ms + 0.2 * ms
            return
        allowed = self.allowed_ms
        if ms > allowed and prefill_tokens * 2 >= self.cap:
            self.cap = max(self.min_tokens, int(self.cap * 0.9 * allowed / ms))
        elif ms < 0.8 * allowed and prefill_tokens >= self.cap:
            self.cap = min(self.max_tokens, self.cap + max(1, self.cap // 4))
