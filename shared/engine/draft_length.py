"""How many tokens a sequence asks the proposers for: its draft length, from its acceptance.

A verification step costs more than a plain decode step (the draft's rows, and steps that
cannot overlap with the next one's preparation), and pays back only the drafts it keeps. So
each speculating sequence tracks the tokens its recent steps gained (drafts accepted per step,
steps with no proposal counted as zero) and:
- after a step that kept its whole draft, asks for more (up to the cap), after one that
  rejected part of it, for one more than it kept: the next draft is as long as the last run of
  agreement suggests;
- when the recent gain falls below ``MIN_GAIN`` tokens a step (prose, or a proposer that finds
  nothing), stops asking (k = 0) for a pause that doubles each time it recurs (from
  ``PAUSE_STEPS`` to ``MAX_PAUSE_STEPS``) and resets after a step that kept a whole draft.
"""

from __future__ import annotations

MIN_GAIN = 0.3  # accepted tokens a step below which speculating does not pay for itself
GAIN_DECAY = 0.7  # weight of the past in the gain's moving average
PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64
START_TOKENS = 4  # the first draft's length (then it follows the acceptance)


class DraftLength:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"a draft length cap must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._k = min(START_TOKENS, max_tokens)
        self.gain = 1.0  # optimistic start: a sequence speculates until shown it does not pay
        self._pause = 0  # plain steps left before asking again
        self._next_pause = PAUSE_STEPS

    @property
    def k(self) -> int:
        """Tokens to ask for now (0: paused)."""
        return 0 if self._pause else self._k

    def observe(self, drafted: int, accepted: int) -> None:
        """One decode step of this sequence: drafted tokens it carried, accepted of them."""
        if self._pause:
            self._pause -= 1
            if not self._pause:
                self.gain = MIN_GAIN  # probe again: one poor step pauses it again
            return
        self.gain = GAIN_DECAY * self.gain + (1 - GAIN_DECAY) * accepted
        if drafted and accepted == drafted:
            self._k = min(self.max_tokens, self._k + 2)
            self._next_pause = PAUSE_STEPS
        elif drafted:
            self._k = min(self.max_tokens, accepted + 1)
        if self.gain < MIN_GAIN:
            self._pause = self._next_pause
            self._next_pause = min(MAX_PAUSE_STEPS, 2 * self._next_pause)
