"""Pre-tokenizer regexes of byte-level BPE vocabularies, keyed by GGUF `tokenizer.ggml.pre`.

Transcribed from llama.cpp's `llm_tokenizer_bpe` (llama-vocab.cpp). llama.cpp applies the
regexes of a pre type one after the other, each splitting the pieces left by the previous one
and keeping both the matches and the text between them; `tokenizers`' `Split(...,
"isolated")` in a `Sequence` does the same. llama.cpp runs the common regexes through
hand-written matchers (gpt2, llama3, qwen2, qwen35) and the rest through std::regex over a
text whose non-ASCII code points are collapsed to their Unicode category; both are the plain
regex semantics reproduced here by Oniguruma, with two caveats: the GPT-2 matcher also ends
in `|\\s+` (llama.cpp's custom code implements it), and code points new in Unicode 15.x may
be classified differently (llama.cpp's tables are Unicode 15.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_WS_TAIL = r"|\s*[\r\n]+|\s+(?!\S)|\s+"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _WS_TAIL
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _WS_TAIL
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    + _WS_TAIL
)
# Case-aware words: llama.cpp rewrites \p{Lu}/\p{Ll} classes as lookaheads over ASCII ranges
_UPPER_THEN_LOWER = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_UPPER_RUN = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
TEKKEN = _UPPER_THEN_LOWER + "|" + _UPPER_RUN + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WS_TAIL
GPT4O = (
    _UPPER_THEN_LOWER
    + _CONTRACTIONS
    + "?|"
    + _UPPER_RUN
    + _CONTRACTIONS
    + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    + _WS_TAIL
)
SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+" + _WS_TAIL
BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreType:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is already a token is not merged
    add_bos: bool = False  # default of add_bos_token when the GGUF does not say


_DEFAULT = PreType((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_LLAMA3 = PreType((LLAMA3,), ignore_merges=True, add_bos=True)
_STARCODER = PreType((r"\p{N}", GPT2))
_GPT2 = PreType((GPT2,))
_QWEN2 = PreType((QWEN2,))
_BLOOM = PreType((BLOOM,))
_GPT4O = PreType((GPT4O,))

_BY_NAME: dict[str, PreType] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _LLAMA3,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreType((LLAMA3,))),
    "falcon": PreType((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(
        (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        _STARCODER,
    ),
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
        ),
        _GPT2,
    ),
    **dict.fromkeys(
        (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        _QWEN2,
    ),
    "qwen35": PreType((QWEN35,)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), _BLOOM),
    "viking": PreType((BLOOM, r"\p{N}")),
    "tekken": PreType((TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "seed-coder": PreType((SEED_CODER,)),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), PreType((BAILINGMOE,))),
    "ufakzeka": PreType((QWEN2[len(_CONTRACTIONS) + 1 :],)),
    "laguna": PreType((r"[^\n]+|[\n]+", QWEN2)),
    "minicpm5": PreType(
        (r"\p{N}{1,3}", QWEN2.replace(r"|\p{N}|", r"|\p{N}+|")), ignore_merges=True
    ),
}


def pre_type(name: str | None) -> PreType:
    """The pre-tokenizer of a GGUF `tokenizer.ggml.pre` value (missing means "default")."""
    entry = _BY_NAME.get(name or "default")
    if entry is None:
        raise NotImplementedError(f"unsupported BPE pre-tokenizer type {name!r}")
    return entry


def build_pre_tokenizer(pre: PreType) -> pre_tokenizers.PreTokenizer:
    """Regex splits, then the GPT-2 byte-to-unicode mapping of every piece."""
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
