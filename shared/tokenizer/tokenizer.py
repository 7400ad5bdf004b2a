"""The `Tokenizer` facade: llama.cpp's tokenize / token_to_piece API over a GGUF vocabulary.

`encode(text, add_special, special)` behaves like `llama_tokenize(vocab, text, add_special,
parse_special)` and `token_to_piece(id)` like `llama_token_to_piece(..., lstrip=0, special)`.
`decode` is the concatenation of pieces, which is what a streaming server prints; it does not
apply `llama_detokenize`'s leading-space removal or `clean_spaces` passes.
"""

from __future__ import annotations

from typing import Any

from shared.tokenizer.bpe import BpeModel
from shared.tokenizer.pretokenize import pre_type
from shared.tokenizer.special import SpecialTokens
from shared.tokenizer.spm import SpmModel
from shared.tokenizer.vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_NORMAL,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
    build_vocab,
)


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to
    code points from U+0100 up, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary, identical to llama.cpp's results."""

    def __init__(self, vocab: Vocab, model: SpmModel | BpeModel) -> None:
        self.vocab = vocab
        self._model = model
        self._spm = isinstance(model, SpmModel)
        self._special = SpecialTokens(vocab)
        self._byte_of = None if self._spm else _gpt2_unicode_to_byte()
        self._pieces: dict[tuple[int, bool], bytes] = {}

    # -- ids ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def bos_id(self) -> int | None:
        return self.vocab.ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.ids["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.ids["eot"]

    @property
    def unk_id(self) -> int | None:
        return self.vocab.ids["unk"]

    @property
    def pad_id(self) -> int | None:
        return self.vocab.ids["pad"]

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation (llama.cpp's `llama_vocab_is_eog` set)."""
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as stored (with "▁" / byte-level characters)."""
        return self.vocab.tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self.vocab.token_to_id.get(text)

    def is_special(self, token_id: int) -> bool:
        """CONTROL or UNKNOWN: printed only when asked for (`special=True`)."""
        return bool(self.vocab.attrs[token_id] & (ATTR_CONTROL | ATTR_UNKNOWN))

    # -- text -> ids -------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, special: bool = False) -> list[int]:
        """Token ids of `text`. `add_special` adds BOS/EOS as the model asks; `special`
        turns the text of control tokens (e.g. "<|im_start|>") into those tokens."""
        fragments = self._special.partition(text, special)
        out: list[int] = []
        if add_special and self.vocab.add_bos:
            out.append(self._required("bos"))
        if self._spm:
            # llama.cpp prefixes a space to text at the start and after every special token
            prefix = " " if self.vocab.add_space_prefix else ""
            after_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    after_special = True
                else:
                    escaped = ((prefix if after_special else "") + frag).replace(" ", "▁")
                    out.extend(self._model.encode(escaped))
                    after_special = False
        else:
            texts = [f for f in fragments if isinstance(f, str)]
            encoded = iter(self._model.encode_many(texts) if texts else [])
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(next(encoded))
        if add_special and self.vocab.add_eos:
            out.append(self._required("eos"))
        return out

    def _required(self, name: str) -> int:
        tid = self.vocab.ids[name]
        if tid is None:
            raise ValueError(f"the model asks for a {name.upper()} token but defines none")
        return tid

    # -- ids -> text -------------------------------------------------------------------
    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token as llama.cpp's `token_to_piece` gives them (may be a
        partial UTF-8 sequence). With `special=False`, control/unknown tokens give b""."""
        key = (token_id, special)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = self._piece(token_id, special)
        return piece

    def _piece(self, token_id: int, special: bool) -> bytes:
        if not 0 <= token_id < self.vocab.size:
            raise IndexError(f"token id {token_id} outside vocabulary of {self.vocab.size}")
        attr = self.vocab.attrs[token_id]
        text = self.vocab.tokens[token_id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN) and not special:
            return b""
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED):
            return text.encode()
        if attr & ATTR_NORMAL:
            if self._spm:
                return text.replace("▁", " ").encode()
            return self._byte_level_decode(text)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # UNDEFINED / UNUSED tokens print nothing, as in llama.cpp

    def _byte_level_decode(self, text: str) -> bytes:
        out = bytearray()
        for ch in text:
            b = self._byte_of.get(ch)
            if b is None:  # llama.cpp's marker for a character outside the byte alphabet
                hexed = ch.encode().hex()
                out += f"[UNK_BYTE_0x{hexed}{text}]".encode()
            else:
                out.append(b)
        return bytes(out)

    def decode_bytes(self, ids: list[int], skip_special: bool = False) -> bytes:
        return b"".join(self.token_to_piece(t, not skip_special) for t in ids)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Concatenated pieces as text; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")


def load_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """Build the tokenizer described by a GGUF file's metadata (`GGUFFile(path).metadata`)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "llama":
        vocab = build_vocab(metadata)
        scores = metadata.get("tokenizer.ggml.scores") or [0.0] * vocab.size
        return Tokenizer(vocab, SpmModel(vocab.token_to_id, scores, vocab.ids["unk"]))
    if kind == "gpt2":
        pre = pre_type(metadata.get("tokenizer.ggml.pre"))
        vocab = build_vocab(metadata, default_add_bos=pre.add_bos)
        return Tokenizer(vocab, BpeModel(metadata, vocab.token_to_id, pre))
    raise NotImplementedError(f"unsupported tokenizer model {kind!r} (llama and gpt2 are)")
