"""Streaming detokenization that never emits a broken UTF-8 sequence.

Works on token bytes (`Tokenizer.token_to_piece`), not on per-token strings: a character can
be split across byte-fallback tokens (`<0xF0><0x9F>...`) or across byte-level BPE tokens, and
only the bytes know where it ends. Python's incremental UTF-8 decoder holds back an
incomplete trailing sequence and, with errors="replace", substitutes exactly what a one-shot
`bytes.decode(..., "replace")` would, so the concatenated output equals `Tokenizer.decode`.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Feed ids one at a time; each `push` returns the text completed by that token."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = not skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text newly completed by `token_id` ("" while a character is still incomplete)."""
        return self._decoder.decode(self._tokenizer.token_to_piece(token_id, self._special))

    def push_many(self, token_ids: list[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: whatever is held back, an incomplete sequence becoming U+FFFD."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

    @property
    def pending(self) -> bool:
        """Whether bytes of an incomplete character are being held back."""
        return bool(self._decoder.getstate()[0])
