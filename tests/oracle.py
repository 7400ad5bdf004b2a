"""llama.cpp (via llama-cpp-python) as the oracle, and Skiff's teacher-forced logits beside it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.kv import KVPool
from shared.kv.calibrate import calibrate
from shared.loader import GGUFFile
from shared.model import ForwardBatch, SeqChunk, load_model
from shared.tokenizer import load_tokenizer

BLOCK = 16


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """[len(ids), vocab] logits from llama.cpp, teacher-forced over `ids` (CPU, f16 KV)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(ids) + 8,
        n_batch=512,
        logits_all=True,
        verbose=False,
        n_threads=os.cpu_count() or 2,
    )
    llm.eval(ids)
    out = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    llm.close()
    return out


def skiff_logits(
    path: Path,
    ids: list[int],
    device: str = "cpu",
    kv_dtype: torch.dtype = torch.float16,
    chunk: int = 0,
    dense_copies: str = "off",
    kv_scales: str = "token",
    cpu_weights: str = "float",
) -> np.ndarray:
    """Teacher-forced logits from Skiff's model; `chunk` > 0 runs the prompt in chunks;
    kv_scales "head" calibrates an FP8 cache's per-head scales first, as the engine does;
    cpu_weights: the CPU worker's quantized linears ("native", "int4"), not float copies."""
    f = GGUFFile(path)
    model = load_model(f, device, dense_copies=dense_copies, cpu_weights=cpu_weights)
    cfg = model.cfg
    n_blocks = -(-len(ids) // BLOCK)
    kv = KVPool(
        cfg.n_layers, n_blocks, BLOCK, cfg.n_kv_heads, cfg.head_dim, kv_dtype, device, kv_scales
    )
    if kv.head_scales:
        calibrate(model, kv, load_tokenizer(f.metadata))
    table = list(range(n_blocks))
    step = chunk or len(ids)
    parts = []
    for start in range(0, len(ids), step):
        batch = ForwardBatch.build(
            [SeqChunk(ids[start : start + step], start, table, "all")], BLOCK, device
        )
        parts.append(model(batch, kv).cpu().numpy())
    return np.concatenate(parts)


@dataclass(frozen=True)
class Agreement:
    positions: int
    top1: float
    mean_abs_diff: float


def compare(ours: np.ndarray, ref: np.ndarray) -> Agreement:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    return Agreement(len(ours), top1, float(np.abs(ours - ref).mean()))
