"""Writes a random-weight GGUF of the Llama-3-8B shape (MODELS.md): d=4096, 32 layers, 32/8 heads,
ffn 14336, vocab 128256, in F16 or written directly as random quantized blocks (Q8_0, Q6_K, or
llama.cpp's Q4_K_M mix: Q6_K for output, and for attn_v / ffn_down in the layers its
``use_more_bits`` rule picks; Q4_K elsewhere). Quantized blocks get random quants and fp16 scales
in [1e-4, 5e-4]. One layer's arrays are reused for every layer: speed does not depend on the
values, and this keeps writing the 5-16 GB files to seconds of CPU time.
Usage: python -m tools.llama3_shape OUT.gguf [--layers 32] [--type f16|q8_0|q6_k|q4_k_m]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from shared.quant import FP16_FIELDS, block_geometry
from tools.synthetic_gguf import add_byte_vocab

D, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256


Q = GGMLQuantizationType
# file type id (llama.cpp's LLAMA_FTYPE) and the type of every matrix but the exceptions
FILE_TYPES = {"f16": (1, Q.F16), "q8_0": (7, Q.Q8_0), "q6_k": (18, Q.Q6_K), "q4_k_m": (15, Q.Q4_K)}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers whose attn_v / ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write(path: Path, layers: int = 32, context: int = 65536, ftype: str = "f16") -> Path:
    rng = np.random.default_rng(0)
    file_type, base = FILE_TYPES[ftype]

    def mat(out: int, inp: int, qtype: GGMLQuantizationType = base) -> tuple[np.ndarray, Q]:
        if qtype == Q.F16:
            x = rng.standard_normal((out, inp), dtype=np.float32)
            x *= 1.0 / np.sqrt(inp)
            return x.astype(np.float16), qtype
        block, size = block_geometry(qtype)
        raw = rng.integers(0, 256, (out * inp // block, size), dtype=np.uint8)
        for off in FP16_FIELDS[qtype]:
            scale = rng.uniform(1e-4, 5e-4, raw.shape[0]).astype(np.float16)
            raw[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
        return raw.reshape(out, -1), qtype

    w = GGUFWriter(str(path), "llama")
    w.add_context_length(context)
    w.add_embedding_length(D)
    w.add_block_count(layers)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(file_type)
    add_byte_vocab(w, VOCAB)
    one = np.ones(D, dtype=np.float32)
    layer = {
        "attn_q": mat(D, D), "attn_k": mat(KV_HEADS * HEAD_DIM, D),
        "attn_v": mat(KV_HEADS * HEAD_DIM, D), "attn_output": mat(D, D),
        "ffn_gate": mat(FFN, D), "ffn_up": mat(FFN, D), "ffn_down": mat(D, FFN),
    }  # fmt: skip
    more = {}  # Q4_K_M: the Q6_K variants of attn_v and ffn_down
    if ftype == "q4_k_m":
        more = {"attn_v": mat(KV_HEADS * HEAD_DIM, D, Q.Q6_K), "ffn_down": mat(D, FFN, Q.Q6_K)}
    add(w, "token_embd.weight", mat(VOCAB, D))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", one)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", one)
        for name, arr in layer.items():
            pick = more.get(name) if use_more_bits(i, layers) else None
            add(w, f"blk.{i}.{name}.weight", pick or arr)
    w.add_tensor("output_norm.weight", one)
    add(w, "output.weight", mat(VOCAB, D, Q.Q6_K if ftype == "q4_k_m" else base))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add(w: GGUFWriter, name: str, tensor: tuple[np.ndarray, Q]) -> None:
    arr, qtype = tensor
    w.add_tensor(name, arr, raw_dtype=None if qtype == Q.F16 else qtype)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--type", choices=sorted(FILE_TYPES), default="f16")
    a = p.parse_args()
    t = time.perf_counter()
    write(a.out, a.layers, ftype=a.type)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s")
