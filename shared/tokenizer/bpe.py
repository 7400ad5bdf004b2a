"""Byte-level BPE (GGUF `tokenizer.ggml.model == "gpt2"`) on top of `tokenizers`.

llama.cpp's `llm_tokenizer_bpe_session` and `tokenizers`' BPE agree on the merge loop (lowest
rank first, leftmost on ties); the differences that remain are handled while building:
duplicate merges keep their first rank (llama.cpp's `emplace`), and merges `tokenizers`
cannot represent (a side or the result missing from the vocabulary) are dropped: llama.cpp
would merge them and then fall back to byte tokens, which a sane vocabulary never asks for.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from shared.tokenizer.pretokenize import PreType, build_pre_tokenizer

_BATCH_CHARS = 4096  # one text longer than this goes through encode_batch (encode_many)


def _parse_merges(lines: list[str], token_to_id: dict[str, int]) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for line in lines:
        pos = line.find(" ", 1)  # llama.cpp splits at the first space after position 0
        if pos < 0:
            continue
        pair = (line[:pos], line[pos + 1 :])
        if pair in seen:
            continue
        seen.add(pair)
        if pair[0] in token_to_id and pair[1] in token_to_id and pair[0] + pair[1] in token_to_id:
            merges.append(pair)
    return merges


class BpeModel:
    """Merges and pre-tokenizer regexes of one vocabulary; no special-token handling."""

    def __init__(self, metadata: dict[str, Any], token_to_id: dict[str, int], pre: PreType):
        merges = _parse_merges(metadata.get("tokenizer.ggml.merges") or [], token_to_id)
        model = models.BPE(
            vocab=token_to_id, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False
        )
        self._hf = HFTokenizer(model)
        self._hf.pre_tokenizer = build_pre_tokenizer(pre)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        # The batch call's thread pool is not worth it for one short text; for a long one it
        # is: it releases the GIL (`encode` holds it: 70 ms for 32k tokens), so a long prompt
        # tokenized on a thread leaves the gateway's event loop running.
        if len(texts) == 1 and len(texts[0]) <= _BATCH_CHARS:
            return [self.encode(texts[0])]
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
