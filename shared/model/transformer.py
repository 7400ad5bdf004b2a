"""Building blocks shared by the architecture files: paged self-attention and the gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.config import ModelConfig
from shared.model.weights import WeightLoader


class Attention(nn.Module):
    """Q/K/V projections (optional bias, per-head QK-norm), RoPE, paged KV write, attention."""

    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightLoader,
        layer: int,
        rope_factors: torch.Tensor | None,
        kv_layer: int | None = None,
    ) -> None:
        super().__init__()
        p = f"blk.{layer}"
        self.cfg = cfg
        self.ops = w.ops
        self.layer = layer if kv_layer is None else kv_layer  # its KV's layer in the pool
        self.qkv = w.split_linear(
            [f"{p}.attn_q", f"{p}.attn_k", f"{p}.attn_v"],
            [cfg.q_dim, cfg.kv_dim, cfg.kv_dim],
            cfg.d_model,
        )
        self.wo = w.linear(f"{p}.attn_output", cfg.d_model, cfg.q_dim)
        self.q_norm = self.k_norm = None
        if w.has(f"{p}.attn_q_norm.weight"):
            self.q_norm = w.vector(f"{p}.attn_q_norm.weight", cfg.head_dim)
            self.k_norm = w.vector(f"{p}.attn_k_norm.weight", cfg.head_dim)
        sliding = cfg.is_sliding(layer)
        self.sliding_window = cfg.sliding_window if sliding else 0
        # sliding-window layers (gemma3) have their own RoPE base and no scaling
        self.rope = (
            (cfg.rope_dim, cfg.rope_base_local, 1.0, None)
            if sliding
            else (cfg.rope_dim, cfg.rope_base, cfg.rope_scale, rope_factors)
        )

    def int8_layouts(self, m: int) -> tuple[tuple[int, int], ...]:
        """The int8 layouts a call of m rows rounds x to for the Q/K/V GEMVs (SplitLinear)."""
        return self.qkv.int8_layouts(m)

    def reads_rounded(self, m: int) -> bool:
        """Whether a call of m rows reads only x's int8 roundings, not x (SplitLinear's)."""
        return self.qkv.reads_rounded(m)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool, rounded: dict | None = None
    ) -> torch.Tensor:
        """rounded: x's int8 roundings by layout, made ahead (int8_layouts), if any."""
        return self.forward_fold(x, batch, kv, rounded, None)[0]

    def forward_fold(
        self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool, rounded: dict | None,
        fold: tuple | None,
    ) -> tuple[torch.Tensor, tuple | None]:  # fmt: skip
        """forward, and with fold (residual, norm weight, eps, layouts) the residual add and
        RMSNorm after it in the output projection's epilogue where it can
        (``QuantLinear.forward_norm``): (out, (new residual, its rounding) or None)."""
        cfg, n = self.cfg, x.shape[0]
        q = k = v = rope = None
        if self.q_norm is None:  # one token: RoPE and the KV write in the GEMV's epilogue
            rope = self.ops.qkv_rope(n, batch, kv, self.layer, self.rope, cfg.rope_neox,
                                     cfg.n_heads)  # fmt: skip
        if rope is not None:
            q = self.qkv.forward_rope(x, rounded, rope)
        if q is None:
            q, k, v = self.qkv(x, rounded)
            k = k.view(n, cfg.n_kv_heads, cfg.head_dim)
            v = v.view(n, cfg.n_kv_heads, cfg.head_dim)
        q = q.view(n, cfg.n_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = self.ops.rms_norm(q, self.q_norm, cfg.rms_eps)
            k = self.ops.rms_norm(k, self.k_norm, cfg.rms_eps)
        # k = v = None: already in the cache. At batch 1 the attention's last pass may round o
        # for wo's GEMV (no launch of its own)
        o, o_rounded = self.ops.attention(
            q,
            k,
            v,
            batch,
            kv,
            self.layer,
            self.rope,
            cfg.rope_neox,
            cfg.attn_scale,
            self.sliding_window,
            self.wo.int8_layout(n),
        )
        o = o.reshape(n, cfg.q_dim)
        done = self.wo.forward_norm(o, o_rounded, *fold) if fold is not None else None
        if done is None:
            return self.wo(o, o_rounded), None
        return done[0], done[1:]


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, layer: int, gelu: bool) -> None:
        super().__init__()
        p = f"blk.{layer}"
        # with the packed kernels: one matmul whose epilogue applies the activation
        self.gated = w.gated_linear(
            f"{p}.ffn_gate", f"{p}.ffn_up", cfg.ffn_dim, cfg.d_model, 2 if gelu else 1
        )
        if self.gated is None:
            self.gate_up = w.split_linear(
                [f"{p}.ffn_gate", f"{p}.ffn_up"], [cfg.ffn_dim, cfg.ffn_dim], cfg.d_model
            )
        self.down = w.linear(f"{p}.ffn_down", cfg.d_model, cfg.ffn_dim)
        self.act = w.ops.gelu_mul if gelu else w.ops.silu_mul

    def int8_layouts(self, m: int) -> tuple[tuple[int, int], ...]:
        """The int8 layouts a call of m rows rounds x to for the gate/up GEMVs."""
        return (self.gated if self.gated is not None else self.gate_up).int8_layouts(m)

    def reads_rounded(self, m: int) -> bool:
        """Whether a call of m rows reads only x's int8 roundings, not x."""
        return (self.gated if self.gated is not None else self.gate_up).reads_rounded(m)

    def forward(self, x: torch.Tensor, rounded: dict | None = None) -> torch.Tensor:
        """rounded: x's int8 roundings by layout, made ahead (int8_layouts), if any."""
        return self.forward_fold(x, rounded, None)[0]

    def forward_fold(
        self, x: torch.Tensor, rounded: dict | None, fold: tuple | None
    ) -> tuple[torch.Tensor, tuple | None]:
        """forward, and with fold the residual add and RMSNorm after it in the down
        projection's epilogue where it can (as Attention.forward_fold)."""
        if self.gated is not None:  # at batch 1 it may round its output for down's GEMV too
            h, h_rounded = self.gated.forward_int8(x, rounded, self.down.int8_layout(x.shape[0]))
        else:
            gate, up = self.gate_up(x, rounded)
            h, h_rounded = self.act(gate, up), None
        done = self.down.forward_norm(h, h_rounded, *fold) if fold is not None else None
        if done is None:
            return self.down(h, h_rounded), None
        return done[0], done[1:]
