"""The draft model's vocabulary against the target's: a draft's token ids mean something to the
worker only where both files give each id the same token, so the service compares the two
GGUF files' tokenizer metadata at start (it never loads the target's weights).

Compared: `tokenizer.ggml.tokens` (the strings) and `tokenizer.ggml.token_type` (normal,
control, byte...), id by id; the first id where they differ (or where one list ends) is named.
"""

from __future__ import annotations

from pathlib import Path

from shared.loader import GGUFFile

_TOKENS, _TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"


class VocabMismatch(ValueError):
    """The draft's vocabulary is not the target's; the message names both files and the id."""


def _first_difference(a: list, b: list) -> int | None:
    """The first index where a and b differ, len of the shorter when one is a prefix of the
    other, None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(values: list, i: int) -> str:
    return repr(values[i]) if i < len(values) else "nothing (its list ends)"


def check_vocab(draft: str | Path, target: str | Path) -> int:
    """Raises VocabMismatch unless the two files' token lists and token types are equal; the
    vocabulary's size when they are."""
    d, t = GGUFFile(draft), GGUFFile(target)
    for key, what in ((_TOKENS, "token"), (_TYPES, "token type")):
        dv, tv = d.get(key), t.get(key)
        if tv is None or dv is None:
            missing = target if tv is None else draft
            raise VocabMismatch(f"{missing} has no {key}: cannot compare the vocabularies")
        i = _first_difference(tv, dv)
        if i is not None:
            raise VocabMismatch(
                f"the draft model {draft} does not have the vocabulary of the target {target}: "
                f"{what} id {i} is {_at(tv, i)} in the target and {_at(dv, i)} in the draft "
                f"({len(tv)} and {len(dv)} tokens)"
            )
    return len(t.get(_TOKENS))
