"""Llama family (Llama 2/3, Mistral, SmolLM) and Qwen2/Qwen3, which differ from it only in ways
the config and the file's tensors already say: Q/K/V biases (qwen2), per-head QK-norm (qwen3) and
the neox RoPE layout (both).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.causal_lm import CausalLM
from shared.model.config import ModelConfig
from shared.model.transformer import Attention, GatedMLP
from shared.model.weights import WeightLoader


class LlamaLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, w: WeightLoader, layer: int, rope_factors: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.eps = cfg.rms_eps
        self.norm = w.ops.rms_norm
        self.attn_norm = w.vector(f"blk.{layer}.attn_norm.weight", cfg.d_model)
        self.attn = Attention(cfg, w, layer, rope_factors)
        self.ffn_norm = w.vector(f"blk.{layer}.ffn_norm.weight", cfg.d_model)
        self.mlp = GatedMLP(cfg, w, layer, gelu=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        h = x + self.attn(self.norm(x, self.attn_norm, self.eps), batch, kv)
        return h + self.mlp(self.norm(h, self.ffn_norm, self.eps))


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, w: WeightLoader, layer: int) -> nn.Module:
        return LlamaLayer(cfg, w, layer, self.rope_factors)
