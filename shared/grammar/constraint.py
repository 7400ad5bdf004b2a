"""One request's grammar as it generates: which tokens may come next, and the tokens it took.

``GrammarCompiler`` holds llguidance's view of the model's vocabulary (every token's bytes, the
end-of-generation ids), built once per worker at its first constrained request; it compiles a
request's grammar (llguidance's JSON form, made by the gateway: services/gateway/structured.py)
into a ``Constraint``.
"""

from __future__ import annotations

from collections import deque

import llguidance

from shared.tokenizer import Tokenizer


class Vocabulary:
    """What llguidance.LLTokenizer asks of a tokenizer: the tokens' bytes, EOS and BOS ids,
    the special ids (matched only by name in a grammar) and an encoder of bytes."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: list[int]) -> None:
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_to_piece(i, special=True) for i in range(n)]
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        special = set(self.special_token_ids)
        self._id_of: dict[bytes, int] = {}
        for i, piece in enumerate(self.tokens):
            if piece and i not in special:
                self._id_of.setdefault(piece, i)
        self._longest = max(map(len, self._id_of), default=1)

    def __call__(self, text: bytes) -> list[int]:
        """Bytes the grammar forces, as tokens: the longest token at each point. Not the
        model's own tokenization (an SPM model's would add a leading space), but the exact
        bytes, which is what the grammar needs."""
        out, at = [], 0
        while at < len(text):
            for n in range(min(self._longest, len(text) - at), 0, -1):
                token = self._id_of.get(text[at : at + n])
                if token is not None:
                    out.append(token)
                    at += n
                    break
            else:
                at += 1  # a byte no token spells: dropped (a vocabulary without byte tokens)
        return out


class GrammarCompiler:
    """Grammars to constraints over one model's vocabulary. n_vocab: the logits' width (a model
    may have more output rows than tokens; those are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        stop_ids = sorted(tokenizer.stop_ids) or [tokenizer.eos_id or 0]
        vocab = llguidance.TokenizerWrapper(Vocabulary(tokenizer, stop_ids))
        self.tokenizer = llguidance.LLTokenizer(vocab, n_vocab=n_vocab, eos_token=stop_ids)
        self.n_vocab = n_vocab

    def compile(self, grammar: str) -> Constraint:
        """ValueError naming the problem if the grammar does not compile."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        return Constraint(matcher)


class Constraint:
    """A compiled grammar's state: masks come from it, sampled tokens advance it.

    With overlapped steps a token reaches the grammar before the engine takes it: the next
    step's mask needs it while that step's forward runs (``take_ahead``); the engine's own
    ``advance`` over the same token then finds it taken."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self._ahead: deque[int] = deque()  # taken ahead of the engine, in order

    def take_ahead(self, token_id: int) -> None:
        self._consume(token_id)
        self._ahead.append(token_id)

    def advance(self, token_id: int) -> bool:
        """Advance over a sampled token (one its mask allowed), unless it was taken ahead;
        True when the output is complete (nothing but end-of-generation may follow).
        ValueError if the grammar refuses the token (one the mask did not allow)."""
        if self._ahead:
            taken = self._ahead.popleft()
            if taken != token_id:
                raise ValueError(f"token {token_id} is not {taken}, taken ahead")
        else:
            self._consume(token_id)
        return self.matcher.is_stopped() and not self._ahead

    @property
    def finished(self) -> bool:
        """Complete (or ended by an end-of-generation token): no further mask is needed."""
        return self.matcher.is_stopped()

    def _consume(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"grammar refused token {token_id}: {self.matcher.get_error()}")
