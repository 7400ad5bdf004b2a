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
        self.add_norm = w.ops.add_rms_norm_int8
        self.attn_norm = w.vector(f"blk.{layer}.attn_norm.weight", cfg.d_model)
        self.attn = Attention(cfg, w, layer, rope_factors)
        self.ffn_norm = w.vector(f"blk.{layer}.ffn_norm.weight", cfg.d_model)
        self.mlp = GatedMLP(cfg, w, layer, gelu=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's MLP output and the residual stream before it (None at the
        first layer) and returns the same pair, so each residual add fuses with the RMSNorm
        that follows it (one kernel on the GPU instead of two). At batch 1 that kernel also
        rounds its output to int8 for the GEMVs that read it (ops.add_rms_norm_int8)."""
        m = x.shape[0]
        layouts = self.attn.int8_layouts(m)
        h, residual, rounded = self.add_norm(x, residual, self.attn_norm, self.eps, layouts)
        a = self.attn(h, batch, kv, rounded)
        layouts = self.mlp.int8_layouts(m)
        h, residual, rounded = self.add_norm(a, residual, self.ffn_norm, self.eps, layouts)
        return self.mlp(h, rounded), residual


class LlamaForCausalLM(CausalLM):
    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, kv)
        return x if residual is None else x + residual

    def make_layer(self, cfg: ModelConfig, w: WeightLoader, layer: int) -> nn.Module:
        return LlamaLayer(cfg, w, layer, self.rope_factors)
