"""Building blocks shared by the architecture files: paged self-attention and the gated MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shared.model.batch import ForwardBatch
from shared.model.config import ModelConfig
from shared.model.weights import WeightLoader
from shared.ops.norm import rms_norm
from shared.ops.paged_attention import paged_attention_ref, write_kv
from shared.ops.rope import apply_rope

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, rope_dim // 2]


class Attention(nn.Module):
    """Q/K/V projections (optional bias, per-head QK-norm), RoPE, paged KV write, attention."""

    def __init__(self, cfg: ModelConfig, w: WeightLoader, layer: int) -> None:
        super().__init__()
        p = f"blk.{layer}"
        self.cfg = cfg
        self.layer = layer
        self.wq = w.linear(f"{p}.attn_q", cfg.q_dim, cfg.d_model)
        self.wk = w.linear(f"{p}.attn_k", cfg.kv_dim, cfg.d_model)
        self.wv = w.linear(f"{p}.attn_v", cfg.kv_dim, cfg.d_model)
        self.wo = w.linear(f"{p}.attn_output", cfg.d_model, cfg.q_dim)
        self.q_norm = self.k_norm = None
        if w.has(f"{p}.attn_q_norm.weight"):
            self.q_norm = w.vector(f"{p}.attn_q_norm.weight", cfg.head_dim)
            self.k_norm = w.vector(f"{p}.attn_k_norm.weight", cfg.head_dim)
        self.sliding_window = cfg.sliding_window if cfg.is_sliding(layer) else 0

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
        rope: Rope,
    ) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q = self.wq(x).view(n, cfg.n_heads, cfg.head_dim)
        k = self.wk(x).view(n, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(x).view(n, cfg.n_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_eps)
        q = apply_rope(q, *rope, neox=cfg.rope_neox)
        k = apply_rope(k, *rope, neox=cfg.rope_neox)
        write_kv(kv[0], kv[1], k, v, batch.slot_mapping)
        o = paged_attention_ref(
            q,
            kv[0],
            kv[1],
            batch.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            cfg.attn_scale,
            self.sliding_window,
        )
        return self.wo(o.reshape(n, cfg.q_dim))


class GatedMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightLoader,
        layer: int,
        act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        p = f"blk.{layer}"
        self.gate = w.linear(f"{p}.ffn_gate", cfg.ffn_dim, cfg.d_model)
        self.up = w.linear(f"{p}.ffn_up", cfg.ffn_dim, cfg.d_model)
        self.down = w.linear(f"{p}.ffn_down", cfg.d_model, cfg.ffn_dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))
