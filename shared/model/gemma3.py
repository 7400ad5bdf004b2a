"""Gemma 3: embeddings scaled by sqrt(d), QK-norm, norms after attention and MLP as well as before,
GELU-tanh gating, and sliding-window layers (5 local : 1 global) with their own RoPE base.
GGUF stores Gemma's RMSNorm weights already as (1 + w), so they multiply directly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.causal_lm import CausalLM
from shared.model.config import ModelConfig
from shared.model.transformer import Attention, GatedMLP
from shared.model.weights import WeightLoader


class Gemma3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, layer: int, kv_layer: int) -> None:
        super().__init__()
        p = f"blk.{layer}"
        self.eps = cfg.rms_eps
        self.norm = w.ops.rms_norm
        self.attn_norm = w.vector(f"{p}.attn_norm.weight", cfg.d_model)
        self.attn = Attention(cfg, w, layer, None, kv_layer)
        self.post_attn_norm = w.vector(f"{p}.post_attention_norm.weight", cfg.d_model)
        self.ffn_norm = w.vector(f"{p}.ffn_norm.weight", cfg.d_model)
        self.mlp = GatedMLP(cfg, w, layer, gelu=True)
        self.post_ffn_norm = w.vector(f"{p}.post_ffw_norm.weight", cfg.d_model)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        norm, eps = self.norm, self.eps
        a = self.attn(norm(x, self.attn_norm, eps), batch, kv)
        h = x + norm(a, self.post_attn_norm, eps)
        m = self.mlp(norm(h, self.ffn_norm, eps))
        return h + norm(m, self.post_ffn_norm, eps)


class Gemma3ForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, w: WeightLoader, layer: int, kv_layer: int) -> nn.Module:
        return Gemma3Layer(cfg, w, layer, kv_layer)

    def embed_scale(self) -> float:
        return math.sqrt(self.cfg.d_model)
