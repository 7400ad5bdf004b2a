"""Writes a random-weight GGUF of the Llama-3-8B shape (MODELS.md): d=4096, 32 layers, 32/8 heads,
ffn 14336, vocab 128256, F16 weights. One layer's arrays are reused for every layer: speed does not
depend on the values, and this keeps writing the 16 GB file to seconds of CPU time.
Usage: python -m tools.llama3_shape OUT.gguf [--layers 32]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from tools.synthetic_gguf import add_byte_vocab

D, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256


def write(path: Path, layers: int = 32, context: int = 65536) -> Path:
    rng = np.random.default_rng(0)

    def mat(out: int, inp: int) -> np.ndarray:
        x = rng.standard_normal((out, inp), dtype=np.float32)
        x *= 1.0 / np.sqrt(inp)
        return x.astype(np.float16)

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
    w.add_file_type(1)  # MOSTLY_F16
    add_byte_vocab(w, VOCAB)
    one = np.ones(D, dtype=np.float32)
    layer = {
        "attn_q": mat(D, D), "attn_k": mat(KV_HEADS * HEAD_DIM, D),
        "attn_v": mat(KV_HEADS * HEAD_DIM, D), "attn_output": mat(D, D),
        "ffn_gate": mat(FFN, D), "ffn_up": mat(FFN, D), "ffn_down": mat(D, FFN),
    }  # fmt: skip
    w.add_tensor("token_embd.weight", mat(VOCAB, D))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", one)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", one)
        for name, arr in layer.items():
            w.add_tensor(f"blk.{i}.{name}.weight", arr)
    w.add_tensor("output_norm.weight", one)
    w.add_tensor("output.weight", mat(VOCAB, D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args()
    t = time.perf_counter()
    write(a.out, a.layers)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s")
