"""Writes small random-weight GGUF models (llama, qwen2, qwen3, gemma3) for tests and benchmarks.

The vocabulary is SentencePiece-style (`<unk> <s> </s>`, the 256 byte tokens, then filler pieces)
so llama.cpp loads the file; tests feed token ids directly. Widths default to multiples of 256 so
every K-quant applies after quantizing with llama.cpp (`quantize_with_llama_cpp`).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

WEIGHTS_VERSION = 3  # bump when the random weights' recipe changes (names cached files)


@dataclass(frozen=True)
class SynthSpec:
    arch: str = "llama"  # llama, qwen2, qwen3, gemma3
    n_layers: int = 2
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 512
    vocab: int = 512
    context: int = 2048
    sliding_window: int = 0  # gemma3 only
    untied: bool = True  # gemma3 ties its output to the embedding only when False
    seed: int = 0
    embd_q8_0: bool = False  # the token embedding (the tied output too) in Q8_0 blocks

    @property
    def name(self) -> str:
        return (
            f"{self.arch}-L{self.n_layers}-d{self.d_model}-h{self.n_heads}x{self.n_kv_heads}"
            f"-f{self.ffn_dim}-v{self.vocab}-s{self.seed}-w{WEIGHTS_VERSION}"
            + ("" if self.untied else "-tied")
            + ("-e8" if self.embd_q8_0 else "")
        )


def _vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n:
        a, b = divmod(i, len(letters))
        tokens.append("▁" + letters[a % 26] + letters[b] + (str(a // 26) if a >= 26 else ""))
        types.append(TokenType.NORMAL)
        i += 1
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(j) for j in range(n - 259)]
    return tokens[:n], scores[:n], [int(t) for t in types[:n]]


def add_byte_vocab(w: GGUFWriter, n: int) -> None:
    """A SentencePiece-style vocabulary of n pieces, so llama.cpp loads the file."""
    tokens, scores, types = _vocab(n)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_synthetic_gguf(path: str | Path, spec: SynthSpec) -> Path:
    """Writes the model to path atomically (a per-process temporary file renamed into place):
    test processes running side by side (pytest-xdist) may write the same file while another
    one maps it."""
    rng = np.random.default_rng(spec.seed)
    path = Path(path)
    tmp = part_path(path)
    w = GGUFWriter(str(tmp), spec.arch)
    a = spec.arch
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.d_model)
    w.add_block_count(spec.n_layers)
    w.add_feed_forward_length(spec.ffn_dim)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6 if a == "gemma3" else 1e-5)
    w.add_rope_freq_base(10000.0)
    if a == "gemma3" and spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    w.add_file_type(0)
    add_byte_vocab(w, spec.vocab)

    def mat(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    d, q, kv = spec.d_model, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    if a == "gemma3":
        # Gemma multiplies embeddings by sqrt(d); with random weights and a tied output the input
        # token would predict itself, so tests use an untied output and strong post-norms.
        embd = mat(spec.vocab, d, 0.25 * np.sqrt(d))
    else:
        # a large embedding gain makes the next-token distribution peaked, like a trained model's
        embd = mat(spec.vocab, d, 4.0 * np.sqrt(d) / 8)
    if spec.embd_q8_0:
        q8 = GGMLQuantizationType.Q8_0
        w.add_tensor("token_embd.weight", quantize(embd, q8), raw_dtype=q8)
    else:
        w.add_tensor("token_embd.weight", embd)
    for i in range(spec.n_layers):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", norm(d))
        w.add_tensor(f"{p}.attn_q.weight", mat(q, d))
        w.add_tensor(f"{p}.attn_k.weight", mat(kv, d))
        w.add_tensor(f"{p}.attn_v.weight", mat(kv, d))
        w.add_tensor(f"{p}.attn_output.weight", mat(d, q))
        if a == "qwen2":
            for n, dim in (("q", q), ("k", kv), ("v", kv)):
                w.add_tensor(
                    f"{p}.attn_{n}.bias", (0.1 * rng.standard_normal(dim)).astype(np.float32)
                )
        if a in ("qwen3", "gemma3"):
            w.add_tensor(f"{p}.attn_q_norm.weight", norm(spec.head_dim))
            w.add_tensor(f"{p}.attn_k_norm.weight", norm(spec.head_dim))
        if a == "gemma3":
            w.add_tensor(f"{p}.post_attention_norm.weight", 4.0 * norm(d))
            w.add_tensor(f"{p}.post_ffw_norm.weight", 4.0 * norm(d))
        w.add_tensor(f"{p}.ffn_norm.weight", norm(d))
        w.add_tensor(f"{p}.ffn_gate.weight", mat(spec.ffn_dim, d))
        w.add_tensor(f"{p}.ffn_up.weight", mat(spec.ffn_dim, d))
        w.add_tensor(f"{p}.ffn_down.weight", mat(d, spec.ffn_dim))
    w.add_tensor("output_norm.weight", norm(d))
    if a != "gemma3" or spec.untied:
        # a gain of 6 gives the logit spread of a trained model (std ~6)
        w.add_tensor("output.weight", mat(spec.vocab, d, 6.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def part_path(dst: str | Path) -> Path:
    """A temporary name beside dst that no other process writes (renamed into place when
    complete: test processes side by side may write the same file)."""
    dst = Path(dst)
    return dst.with_name(f"{dst.name}.{os.getpid()}.part")


def quantize_with_llama_cpp(src: str | Path, dst: str | Path, ftype_name: str) -> Path:
    """ftype_name like 'Q4_K_M', 'Q6_K', 'Q8_0' (llama.cpp's LLAMA_FTYPE_MOSTLY_<name>)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = os.cpu_count() or 2
    tmp = str(part_path(dst))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        Path(tmp).unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp failed to quantize {src} to {ftype_name} (rc={rc})")
    os.replace(tmp, dst)
    return Path(dst)


def synthetic(spec: SynthSpec, ftype: str, d: Path) -> Path:
    """The model of `spec` in directory d as `ftype` ("F32" or a llama.cpp file type name):
    written (F32) and quantized by llama.cpp the first time, found there after (a machine
    without llama-cpp-python takes the quantized files carried to it)."""
    src = d / f"{spec.name}.f32.gguf"
    if not src.exists():
        write_synthetic_gguf(src, spec)
    if ftype == "F32":
        return src
    dst = d / f"{spec.name}.{ftype}.gguf"
    if not dst.exists():
        quantize_with_llama_cpp(src, dst, ftype)
    return dst
