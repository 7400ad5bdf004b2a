"""A quantized model as CUDA keeps it, on any device: for the batch-1 epilogue tests
(test_qkv_rope_model, test_norm_ahead_model), which run it under TRITON_INTERPRET=1 on the CPU
and natively on CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shared.kernels.qmatmul.packed_rows import interleave, wants_rows
from shared.kv import KVPool
from shared.loader import GGUFFile
from shared.model import ForwardBatch, SeqChunk, load_model
from shared.model.linear import QuantLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 8


def load_interleaved(path: Path) -> torch.nn.Module:
    """The model in bf16 with the Triton ops, its int8 types' planes row-interleaved (the rows
    GEMV's layout, which loading makes on CUDA only)."""
    model = load_model(GGUFFile(path, cache_dir=path.parent), DEVICE, torch.bfloat16,
                       cache_dequantized=False, ops="triton")  # fmt: skip
    for m in model.modules():
        packed = m.packed if isinstance(m, QuantLinear) else None
        if packed is not None and not packed.rows32 and wants_rows(m.qtype):
            m.packed = interleave(packed)
    return model


def decode_logits(model: torch.nn.Module, ids: list[int], prompt: int) -> np.ndarray:
    """The logits of ids[:prompt] as one chunk, then of each later id in a one-token step."""
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 4, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16, DEVICE)
    table, out, start = [3, 1, 2, 0], [], 0
    for n in [prompt] + [1] * (len(ids) - prompt):
        batch = ForwardBatch.build([SeqChunk(ids[start : start + n], start, table, "all")],
                                   BLOCK, DEVICE)  # fmt: skip
        out.append(model(batch, kv).float().cpu().numpy())
        start += n
    return np.concatenate(out)
