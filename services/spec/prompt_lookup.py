"""Prompt lookup: what followed the most recent earlier occurrence of a sequence's current
suffix in its own tokens (prompt and output so far), the longest suffix that occurs first.

Code edits, quoting and extraction copy long runs of the prompt into the output; where the
output is at an n-gram that occurred before, what followed it then is a cheap guess of what
follows now. `PromptLookup` keeps one sequence's tokens and, for each n in [n_min, n_max], a
dict from an n-gram to the position right after its most recent occurrence whose next token is
known (`_last`). Appending a token indexes the n-grams that end before it (n_max - n_min + 1 dict
writes); proposing looks the current suffix up, longest first (as many dict reads), and slices
what follows: neither scans the history.

Truncation (the worker resends from an earlier position) walks back an undo chain: `_prev`
holds, per position, the value its n-gram's entry had before that position was indexed, so
cutting m tokens costs m * (n_max - n_min + 1) dict writes, the same as appending them; the
index then equals one built fresh over the kept tokens (the test checks that on random streams).

Sizes 3..8 by default (config.py). llama.cpp's lookup indexes 1..4 and vLLM's docs show a
lookup of up to 4, but a simulation here (SmolLM2's tokenizer, a draft of 8, each step keeping
the draft's agreeing prefix plus one token) says longer n-grams find the right place to copy
from: on "rename X to Y and return the whole file" for three standard-library modules
(textwrap, shlex, colorsys; ~3k tokens each), 2..4 gained 7.5/6.3/6.7 tokens a step and 3..8
8.6/7.6/8.1 (2..12: 8.8/7.9/8.5, beyond that little); on prose (a story's second half after
its first) 1..4 proposed 4.2 rejected tokens a step, 2..x 0.9 and 3..x 0.1, for no gain with
any. So n_min 3 (a unigram or bigram "match" in prose is noise) and n_max 8 (each size costs a
dict write per token, so not 12).

Measured (CPython 3.11, one core of an AMD EPYC dev machine, a 4,096-token history of random
ids from a 49k vocabulary, n 3..8): a proposal of 8 tokens takes ~0.6 us when the 8-gram
matches, ~1.3 us when a 4-gram does or nothing does; appending one token ~4.9 us; cutting 96
tokens and appending them again ~0.22 ms; a resend of the 4,096 tokens it holds ~19 us;
indexing a 4,096-token prompt at once ~5.7 ms (the one costly call: service.py says what a
worker should do about it); the index holds ~2.9 MB for it (~0.7 KB a token).
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """One sequence's tokens and its n-gram index; `propose(k)` is what may follow them."""

    def __init__(self, n_min: int, n_max: int, tokens: Sequence[int] = ()) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        sizes = n_max - n_min + 1
        # per n (index n - n_min): n-gram -> the position after its latest indexed occurrence
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(sizes)]
        # per n: position p -> what _last held for the n-gram ending before p until p was
        # indexed (-1: nothing; also the filler for p < n, which indexes nothing)
        self._prev: list[list[int]] = [[] for _ in range(sizes)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        toks = self.tokens
        start = len(toks)
        toks.extend(new)
        for i, n in enumerate(range(self.n_min, self.n_max + 1)):
            last, prev = self._last[i], self._prev[i]
            get = last.get
            for p in range(start, len(toks)):
                if p < n:  # no n-gram ends before p
                    prev.append(-1)
                    continue
                gram = tuple(toks[p - n : p])  # its next token, toks[p], is now known
                prev.append(get(gram, -1))
                last[gram] = p

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens; the index becomes the one those alone would give."""
        toks = self.tokens
        if length >= len(toks):
            return
        for i, n in enumerate(range(self.n_min, self.n_max + 1)):
            last, prev = self._last[i], self._prev[i]
            for p in range(len(toks) - 1, max(length, n) - 1, -1):  # newest first: LIFO undo
                gram = tuple(toks[p - n : p])
                if prev[p] < 0:
                    del last[gram]
                else:
                    last[gram] = prev[p]
            del prev[length:]
        del toks[length:]

    def update(self, start: int, tokens: Sequence[int]) -> int | None:
        """Cut the copy at `start` and append `tokens`; how many tokens it kept before the
        append (None, and nothing changed, when `start` is past its end). Tokens the copy
        already holds there are kept, not undone and redone: a resend costs one comparison."""
        if start > len(self.tokens):
            return None
        same = min(len(self.tokens) - start, len(tokens))
        held, sent = self.tokens[start : start + same], list(tokens[:same])
        if held != sent:  # else the common run is all of the shorter
            same = next(i for i, (a, b) in enumerate(zip(held, sent, strict=True)) if a != b)
        self.truncate(start + same)
        self.extend(tokens[same:])
        return start + same

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        (n_max down to n_min) that occurred before; [] when none did. Never past the history's
        end: the suffix itself is not indexed (its next token is unknown), so a match lies
        before it and at least one token follows the match."""
        toks = self.tokens
        size = len(toks)
        if k <= 0:
            return []
        for i in range(min(self.n_max, size) - self.n_min, -1, -1):
            n = self.n_min + i
            p = self._last[i].get(tuple(toks[size - n :]))
            if p is not None:
                return toks[p : p + k]
        return []

    def check_integrity(self) -> None:
        """The index equals one built by a scan of the tokens (tests; O(len * sizes))."""
        for i, n in enumerate(range(self.n_min, self.n_max + 1)):
            want: dict[tuple[int, ...], int] = {}
            for p in range(n, len(self.tokens)):
                want[tuple(self.tokens[p - n : p])] = p
            assert self._last[i] == want, f"the {n}-gram index differs from a scan"
            assert len(self._prev[i]) == len(self.tokens), f"the {n}-gram undo chain's length"
