"""How many prompt tokens a step may take while other requests are decoding.

A long prompt's chunk lengthens every step it rides in, and so the gap between the tokens the
decoding streams receive. ``ChunkBudget`` sizes each chunk from what a step costs on this device
(``StepCost``, fitted from the steps the worker runs and seeded by its start-up calibration):
the largest chunk whose step is predicted to stay within the allowed time. Steps without decodes
are not capped: nobody waits on them, and they take the largest chunk the step allows.

The allowed time is twice the decodes' own step (the step the decoding streams would have
without the prompt), and never under a floor (``floor_ms``, or the target given by
``--step-target-ms``). So the prompt gets at least about half of every step it shares: its
first token comes within about twice its unconstrained time, while the streams' gaps stay
within about twice their gaps before it arrived. A fixed token count cannot do both on every
device: 512 tokens is a 15 ms step on an H200 and 1.7 s on two CPU cores.
"""

from __future__ import annotations

from shared.engine.step_cost import StepCost, chunk_pairs

__all__ = ["ChunkBudget", "FLOOR_MS"]

FLOOR_MS = 20.0  # the allowed time of a step with decodes never goes under this
# a chunk beside decodes gets at least this (the prompt always moves on). It was 18 while the
# CPU's attention took chunks of up to 17 rows one by one and longer ones in one fused call;
# the CPU library attends every row alike, so a chunk's cost no longer jumps at 18
MIN_TOKENS = 8
COLD_TOKENS = 64  # a chunk's tokens before the cost model has seen steps of two sizes


class ChunkBudget:
    def __init__(
        self,
        max_tokens: int,
        target_ms: float = 0.0,
        floor_ms: float = FLOOR_MS,
        min_tokens: int = MIN_TOKENS,
        cost: StepCost | None = None,
    ) -> None:
        """target_ms > 0 replaces floor_ms (a user's --step-target-ms); 0 keeps floor_ms."""
        if target_ms < 0 or floor_ms <= 0:
            raise ValueError(f"target_ms must be >= 0, floor_ms > 0: {target_ms}, {floor_ms}")
        self.max_tokens = max_tokens
        self.floor_ms = target_ms if target_ms > 0 else floor_ms
        self.min_tokens = min(min_tokens, max_tokens)
        self.cost = cost or StepCost()

    def allowed_ms(self, tokens: int, pairs: int) -> float:
        """The time a step whose decodes compute `tokens` rows over `pairs` may take."""
        return max(self.floor_ms, 2.0 * self.cost.predict_ms(tokens, pairs))

    def chunk(self, tokens: int, pairs: int, prefix: int, want: int, allowed_ms: float) -> int:
        """Tokens of a prompt chunk (at most `want`, after `prefix` computed tokens) to add to a
        step that already holds `tokens` rows over `pairs`: the most that keep the predicted
        step within allowed_ms, and never fewer than min_tokens."""
        floor = min(want, self.min_tokens)
        if not self.cost.ready:
            return min(want, max(floor, COLD_TOKENS))
        lo, hi = floor, min(want, self.max_tokens)
        while lo < hi:  # the largest n that fits (predicted time grows with n)
            mid = (lo + hi + 1) // 2
            ms = self.cost.predict_ms(tokens + mid, pairs + chunk_pairs(mid, prefix))
            if ms <= allowed_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        """Account one finished step: its rows, its query-key pairs, its time."""
        self.cost.observe(tokens, pairs, seconds)
