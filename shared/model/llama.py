"""Llama family (Llama 2/3, Mistral, SmolLM) and Qwen2/Qwen3, which differ from it only in ways
the config and the file's tensors already say: Q/K/V biases (qwen2), per-head QK-norm (qwen3) and
the neox RoPE layout (both).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.batch import ForwardBatch
from shared.model.causal_lm import CausalLM
from shared.model.config import ModelConfig
from shared.model.transformer import Attention, GatedMLP, Rope
from shared.model.weights import WeightLoader
from shared.ops.activation import silu_mul
from shared.ops.norm import rms_norm


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, layer: int) -> None:
        super().__init__()
        self.eps = cfg.rms_eps
        self.attn_norm = w.vector(f"blk.{layer}.attn_norm.weight", cfg.d_model)
        self.attn = Attention(cfg, w, layer)
        self.ffn_norm = w.vector(f"blk.{layer}.ffn_norm.weight", cfg.d_model)
        self.mlp = GatedMLP(cfg, w, layer, silu_mul)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
        rope: Rope,
    ) -> torch.Tensor:
        h = x + self.attn(rms_norm(x, self.attn_norm, self.eps), batch, kv, rope)
        return h + self.mlp(rms_norm(h, self.ffn_norm, self.eps))


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, w: WeightLoader, layer: int) -> nn.Module:
        return LlamaLayer(cfg, w, layer)
