"""Vocabulary facts read from GGUF metadata the way llama.cpp's `llama_vocab::load` reads them.

Token attributes, special ids (with llama.cpp's per-model-type defaults), add_bos/add_eos/
add_space_prefix, and the end-of-generation set. llama.cpp patches several of these by token
*text* (an EOT-looking token that is not typed CONTROL becomes CONTROL, `</s>` becomes EOG,
...); the patches change what `parse_special` matches and what `token_to_piece` prints, so
they are mirrored here one for one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# llama_token_attr bit flags (llama.h)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# GGUF token_type (llama_token_type) -> attribute; anything else is UNDEFINED
_TYPE_TO_ATTR = (
    ATTR_UNDEFINED,
    ATTR_NORMAL,
    ATTR_UNKNOWN,
    ATTR_CONTROL,
    ATTR_USER_DEFINED,
    ATTR_UNUSED,
    ATTR_BYTE,
)

_K = "tokenizer.ggml."

# (field, metadata key) in llama.cpp's order; the deprecated FIM keys come last and win
_ID_KEYS = (
    ("bos", "bos_token_id"),
    ("eos", "eos_token_id"),
    ("eot", "eot_token_id"),
    ("eom", "eom_token_id"),
    ("unk", "unknown_token_id"),
    ("sep", "seperator_token_id"),  # sic: llama.cpp's key name
    ("pad", "padding_token_id"),
    ("mask", "mask_token_id"),
    ("fim_pre", "fim_pre_token_id"),
    ("fim_suf", "fim_suf_token_id"),
    ("fim_mid", "fim_mid_token_id"),
    ("fim_pad", "fim_pad_token_id"),
    ("fim_rep", "fim_rep_token_id"),
    ("fim_sep", "fim_sep_token_id"),
    ("fim_pre", "prefix_token_id"),
    ("fim_suf", "suffix_token_id"),
    ("fim_mid", "middle_token_id"),
)

# Ids llama.cpp finds by text when the metadata does not name them (first hit wins).
_DETECT_BY_TEXT = {
    "eot": (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}

# Texts that end generation wherever they appear in a vocabulary (llama.cpp's EOG list).
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)


@dataclass
class Vocab:
    """Everything about the vocabulary except the segmentation algorithm itself."""

    model: str  # "llama" (SPM) or "gpt2" (byte-level BPE)
    pre: str
    tokens: list[str]
    attrs: list[int]
    token_to_id: dict[str, int]
    ids: dict[str, int | None]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def special_ids(self) -> list[int]:
        """Ids the special-token partition may cut out (CONTROL, USER_DEFINED, UNKNOWN)."""
        mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        return [i for i, a in enumerate(self.attrs) if a & mask]


def _bool(metadata: dict[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(_K + key)
    return default if value is None else bool(value)


def build_vocab(metadata: dict[str, Any], default_add_bos: bool = False) -> Vocab:
    """Read tokens, attributes and special ids; `default_add_bos` is the pre-type's default."""
    model = metadata.get(_K + "model")
    tokens = list(metadata[_K + "tokens"])
    n = len(tokens)
    for i, text in enumerate(tokens):
        if not text:  # llama.cpp renames empty tokens so that they stay unique
            tokens[i] = f"[EMPTY_{i}]"
    types = metadata.get(_K + "token_type")
    if types is None:
        attrs = [ATTR_NORMAL] * n
    else:
        attrs = [_TYPE_TO_ATTR[t] if 0 <= t < 7 else ATTR_UNDEFINED for t in types[:n]]
    token_to_id = {text: i for i, text in enumerate(tokens)}

    spm = model == "llama"
    ids: dict[str, int | None] = {name: None for name, _ in _ID_KEYS}
    if spm:  # llama.cpp's defaults when the GGUF names no ids
        ids.update(bos=1, eos=2, unk=0)
    else:
        ids.update(bos=11, eos=11)
    for name, key in _ID_KEYS:
        if ids[name] is not None and ids[name] >= n:  # default out of range: disabled
            ids[name] = None
        value = metadata.get(_K + key)
        if value is not None and 0 <= value < n:
            ids[name] = int(value)

    def mark_control(tid: int) -> None:
        attrs[tid] |= ATTR_CONTROL

    for name, texts in _DETECT_BY_TEXT.items():
        if ids[name] is None:
            hit = next((token_to_id[t] for t in texts if t in token_to_id), None)
            if hit is not None:
                ids[name] = hit
                mark_control(hit)

    eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
    for text in _EOG_TEXTS:
        tid = token_to_id.get(text)
        if tid is not None:
            eog.add(tid)
            mark_control(tid)
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if text in token_to_id:  # gpt-oss: always rendered, never control
            attrs[token_to_id[text]] = ATTR_USER_DEFINED
    eog.update(ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None)
    _apply_eog_exceptions(eog, tokens, attrs)

    add_bos = _bool(metadata, "add_bos_token", spm or default_add_bos)
    add_eos = _bool(metadata, "add_eos_token", False)
    vocab = Vocab(
        model=model,
        pre=metadata.get(_K + "pre") or "default",
        tokens=tokens,
        attrs=attrs,
        token_to_id=token_to_id,
        ids=ids,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=_bool(metadata, "add_space_prefix", spm),
        eog_ids=frozenset(eog),
    )
    _apply_strip_attrs(vocab, str(metadata.get("general.name") or ""))
    return vocab


def _apply_eog_exceptions(eog: set[int], tokens: list[str], attrs: list[int]) -> None:
    """`<|end|>` is no EOG next to harmony's `<|return|>`/`<|call|>`; `</s>` is plain text
    in vocabularies that also have `<|tool_response>` (as llama.cpp decides)."""
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (
        ("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
        or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)
    ):
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = ATTR_NORMAL


def _apply_strip_attrs(vocab: Vocab, model_name: str) -> None:
    """Phi-3 special tokens swallow the whitespace after them (llama.cpp sets RSTRIP by name)."""
    name = model_name.lower()
    if "phi-3" not in name and "phi3" not in name:
        return
    for tid in vocab.special_ids():
        vocab.attrs[tid] |= ATTR_RSTRIP
    for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
        tid = vocab.token_to_id.get(text)
        if tid is not None:
            vocab.attrs[tid] = (
                (vocab.attrs[tid] | ATTR_RSTRIP) if on else (vocab.attrs[tid] & ~ATTR_RSTRIP)
            )
