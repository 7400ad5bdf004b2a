"""A worker's structured output: each constrained request's grammar compiled over the model's
vocabulary (shared/grammar). The vocabulary's llguidance form (every token's bytes) is built at
the first constrained request, not at start: ~0.2 s for SmolLM2's 49k tokens, ~2 s for Gemma
3's 262k, paid once and only by a worker that is asked for it."""

from __future__ import annotations

from shared.grammar import Constraint, GrammarCompiler
from shared.loader import GGUFFile
from shared.tokenizer import load_tokenizer


class Constraints:
    def __init__(self, model_path: str, n_vocab: int) -> None:
        self.model_path = model_path
        self.n_vocab = n_vocab  # the logits' width
        self._compiler: GrammarCompiler | None = None

    def compile(self, grammar: str, output_ids: list[int]) -> Constraint:
        """The grammar's constraint, advanced over a resumed request's tokens so far.
        ValueError (a 400 for the request) if it does not compile or they do not match it."""
        if self._compiler is None:
            tokenizer = load_tokenizer(GGUFFile(self.model_path).metadata)
            self._compiler = GrammarCompiler(tokenizer, self.n_vocab)
        constraint = self._compiler.compile(grammar)
        for token in output_ids:
            constraint.advance(token)
        return constraint
