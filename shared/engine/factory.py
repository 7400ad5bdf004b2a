"""Builds a ready engine (model, KV pool, allocator, tokenizer) for one device from one config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.engine import LLMEngine
from shared.engine.model_runner import ModelRunner
from shared.kv import BlockAllocator, KVPool
from shared.loader import GGUFFile
from shared.model import load_model
from shared.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"  # activations and KV: float32, float16 or bfloat16
    block_size: int = 16
    max_model_len: int = 0  # 0 = the model's context length, capped at 8192
    kv_blocks: int = 0  # 0 = enough for max_seqs_kv full-length sequences
    max_seqs_kv: int = 4
    max_batch_tokens: int = 2048
    cache_dequantized: bool | None = None  # None = yes on CPU


@dataclass
class LoadedEngine:
    engine: LLMEngine
    tokenizer: Tokenizer
    gguf: GGUFFile


def build_engine(cfg: EngineConfig) -> LoadedEngine:
    f = GGUFFile(cfg.model_path)
    dtype = getattr(torch, cfg.dtype)
    model = load_model(f, cfg.device, dtype, cfg.cache_dequantized)
    mc = model.cfg
    max_len = cfg.max_model_len or min(mc.context_length, 8192)
    num_blocks = cfg.kv_blocks or cfg.max_seqs_kv * -(-max_len // cfg.block_size)
    kv = KVPool(
        mc.n_layers, num_blocks, cfg.block_size, mc.n_kv_heads, mc.head_dim, dtype, cfg.device
    )
    runner = ModelRunner(model, kv, cfg.device)
    engine = LLMEngine(runner, BlockAllocator(num_blocks), max_len, cfg.max_batch_tokens)
    return LoadedEngine(engine, load_tokenizer(f.metadata), f)
