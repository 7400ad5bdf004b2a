"""Skiff's tokenizer against llama.cpp (llama-cpp-python, vocab_only) on real GGUF vocabularies.

Models come from SKIFF_SMOLLM2 (byte-level BPE, pre "smollm") and SKIFF_GEMMA3 (SentencePiece,
262k pieces); tests skip when unset. Further BPE pre-tokenizer types and an SPM vocabulary with
add_space_prefix are checked on synthetic vocab-only GGUFs built from those two vocabularies.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest

from shared.loader import GGUFFile
from shared.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from tests.tokenizer_corpus import CORPUS

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

MODELS = {"smollm2": "SKIFF_SMOLLM2", "gemma3": "SKIFF_GEMMA3"}


def _model_path(name: str) -> str:
    path = os.environ.get(MODELS[name])
    if not path or not Path(path).is_file():
        pytest.skip(f"{MODELS[name]} is not set to a GGUF file")
    return path


def _llama(path: str | Path):
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def _llama_piece(llm, token_id: int, special: bool) -> bytes:
    # llama-cpp-python's own helpers use a 32-byte buffer and truncate longer pieces
    buf = ctypes.create_string_buffer(512)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    n = llama_cpp.llama_token_to_piece(vocab, token_id, buf, len(buf), 0, special)
    assert n >= 0
    return buf.raw[:n]


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request) -> tuple[str, Tokenizer, object]:
    path = _model_path(request.param)
    metadata = GGUFFile(path).metadata
    return request.param, load_tokenizer(metadata), _llama(path)


def _mismatches(tok: Tokenizer, llm, texts: list[str], special: bool) -> list[str]:
    bad = []
    for text in texts:
        for add_special in (True, False):
            ours = tok.encode(text, add_special=add_special, special=special)
            ref = llm.tokenize(text.encode(), add_bos=add_special, special=special)
            if ours != ref:
                bad.append(f"{text!r} add_special={add_special}: {ours[:12]} != {ref[:12]}")
    return bad


def test_corpus_is_broad():
    assert len(CORPUS) >= 60
    assert "" in CORPUS and " " in CORPUS and "\n\n\n" in CORPUS


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_ids_match_llama_cpp(pair, index, special):
    _, tok, llm = pair
    assert _mismatches(tok, llm, [CORPUS[index]], special) == []


def test_long_text_matches_llama_cpp(pair):
    """A text past bpe._BATCH_CHARS (byte-level BPE encodes it in the batch call, which
    releases the GIL) gives llama.cpp's ids."""
    _, tok, llm = pair
    long = "\n".join(CORPUS) * 8
    assert len(long) > 4 * 4096
    assert _mismatches(tok, llm, [long], True) == []


def test_special_flag_changes_result(pair):
    name, tok, _ = pair
    text = "<|im_start|>user" if name == "smollm2" else "<start_of_turn>user"
    control = tok.token_to_id(text.split("user")[0])
    assert control in tok.encode(text, special=True)
    assert control not in tok.encode(text, special=False)


def test_ids_and_stop_set_match_llama_cpp(pair):
    _, tok, llm = pair
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    assert tok.vocab_size == llm.n_vocab()
    assert tok.bos_id == llm.token_bos()
    assert tok.eos_id == llm.token_eos()
    eog = {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.stop_ids == eog
    assert tok.eos_id in tok.stop_ids and all(tok.is_eog(i) for i in eog)


@pytest.mark.parametrize("special", [False, True])
def test_every_token_piece_matches_llama_cpp(pair, special):
    _, tok, llm = pair
    bad = [
        i
        for i in range(tok.vocab_size)
        if tok.token_to_piece(i, special) != _llama_piece(llm, i, special)
    ]
    assert bad == []


def test_decode_matches_llama_detokenize(pair):
    _, tok, llm = pair
    checked = 0
    for text in CORPUS:
        ids = tok.encode(text, add_special=False, special=True)
        # llm.detokenize truncates pieces over 32 bytes and drops a space after BOS
        if not ids or ids[0] == tok.bos_id or any(len(tok.token_to_piece(i)) > 32 for i in ids):
            continue
        assert tok.decode_bytes(ids, skip_special=True) == llm.detokenize(ids)
        assert tok.decode_bytes(ids) == llm.detokenize(ids, special=True)
        assert tok.decode(ids) == llm.detokenize(ids, special=True).decode("utf-8", "replace")
        checked += 1
    assert checked >= 50


@pytest.mark.parametrize("text", CORPUS)
def test_plain_text_round_trips(pair, text):
    _, tok, _ = pair
    assert tok.decode(tok.encode(text, add_special=False), skip_special=True) == text


@pytest.mark.parametrize("skip_special", [False, True])
def test_incremental_detokenizer_equals_full_decode(pair, skip_special):
    _, tok, _ = pair
    held_back = 0
    for text in CORPUS:
        ids = tok.encode(text, add_special=True, special=True)
        detok = IncrementalDetokenizer(tok, skip_special=skip_special)
        chunks = [detok.push(i) for i in ids]
        chunks.append(detok.flush())
        full = tok.decode(ids, skip_special=skip_special)
        assert "".join(chunks) == full, text
        if "\ufffd" not in full:
            assert not any("\ufffd" in c for c in chunks), text
        # a token with bytes but no text yet: part of a character was held back
        held_back += sum(
            1
            for i, chunk in zip(ids, chunks, strict=False)
            if tok.token_to_piece(i, not skip_special) and not chunk
        )
    assert held_back > 0  # the corpus does split characters across tokens


def test_detokenizer_holds_back_split_character(pair):
    _, tok, _ = pair
    ids = tok.encode("🫨", add_special=False)
    assert len(ids) > 1  # neither vocabulary has this emoji as one token
    detok = IncrementalDetokenizer(tok)
    out = [detok.push(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🫨"
    assert not detok.pending and detok.flush() == ""
    detok.push(ids[0])
    assert detok.pending and detok.flush() == "\ufffd"


def test_load_is_quick(pair):
    name, _, _ = pair
    metadata = GGUFFile(_model_path(name)).metadata
    start = time.perf_counter()
    load_tokenizer(metadata)
    assert time.perf_counter() - start < 2.0


# -- synthetic vocabularies: other pre-tokenizers and SPM options ---------------------------

BPE_PRE_TYPES = [
    "gpt-2", "llama-bpe", "qwen2", "default", "falcon", "qwen35", "gpt-4o", "tekken",
    "seed-coder", "bailingmoe", "poro-chat", "viking", "dbrx", "ufakzeka", "laguna", "minicpm5",
]  # fmt: skip


def _write_vocab_gguf(path: Path, md: dict) -> Path:
    """A vocab-only GGUF (tiny fake llama hparams, no tensors) with `md`'s vocabulary."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(md.get("general.name", "synthetic"))
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in md:
        w.add_token_scores(md["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in md:
        w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    for key, add in (
        ("add_bos_token", w.add_add_bos_token),
        ("add_eos_token", w.add_add_eos_token),
        ("add_space_prefix", w.add_add_space_prefix),
    ):
        if md.get(f"tokenizer.ggml.{key}") is not None:
            add(md[f"tokenizer.ggml.{key}"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _synthetic_mismatches(tmp_path: Path, source: str, **overrides) -> list[str]:
    md = {**GGUFFile(_model_path(source)).metadata, **overrides}
    path = _write_vocab_gguf(tmp_path / "vocab.gguf", md)
    # the file holds exactly `md` (None = key left out); re-parsing it would only cost time
    tok = load_tokenizer({k: v for k, v in md.items() if v is not None})
    llm = _llama(path)
    return _mismatches(tok, llm, CORPUS, False) + _mismatches(tok, llm, CORPUS, True)


@pytest.mark.parametrize("pre", BPE_PRE_TYPES)
def test_bpe_pre_types_match_llama_cpp(tmp_path, pre):
    # add_bos left out so that each pre type's own default (llama3: True) is exercised
    assert (
        _synthetic_mismatches(
            tmp_path, "smollm2", **{"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": None}
        )
        == []
    )


def test_bpe_add_eos_and_phi3_rstrip_match_llama_cpp(tmp_path):
    md = GGUFFile(_model_path("smollm2")).metadata
    tokens = list(md["tokenizer.ggml.tokens"])
    tokens[5:8] = ["</s>", "<unk>", "<s>"]  # llama.cpp's Phi-3 rule looks these up by text
    assert (
        _synthetic_mismatches(
            tmp_path,
            "smollm2",
            **{
                "general.name": "Phi-3 synthetic",
                "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.add_eos_token": True,
            },
        )
        == []
    )


def test_spm_space_prefix_and_default_bos_match_llama_cpp(tmp_path):
    # Llama-2 style: a space is prefixed to the text and after every special token
    assert (
        _synthetic_mismatches(
            tmp_path,
            "gemma3",
            **{"tokenizer.ggml.add_space_prefix": True, "tokenizer.ggml.add_bos_token": None},
        )
        == []
    )
