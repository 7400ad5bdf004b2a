"""A worker's structured output: each constrained request's grammar compiled over the model's
vocabulary (shared/grammar). The vocabulary's llguidance form (every token's bytes) is built at
the first constrained request, not at start: ~0.2 s for SmolLM2's 49k tokens, ~2 s for Gemma
3's 262k, paid once and only by a worker that is asked for it."""

from __future__ import annotations

from shared.grammar import Constraint, GrammarCompiler
from shared.tokenizer import Tokenizer


class Constraints:
    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self.tokenizer = tokenizer  # the engine's (LoadedEngine.tokenizer)
        self.n_vocab = n_vocab  # the logits' width
        self._compiler: GrammarCompiler | None = None

    def compile(self, grammar: str, output_ids: list[int]) -> Constraint:
        """The grammar's constraint, advanced over a resumed request's tokens so far.
        ValueError (a 400 for the request) if it does not compile or they do not match it."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.n_vocab)
        constraint = self._compiler.compile(grammar)
        for token in output_ids:
            constraint.advance(token)
        return constraint
