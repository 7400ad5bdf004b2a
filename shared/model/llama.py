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
        self,
        cfg: ModelConfig,
        w: WeightLoader,
        layer: int,
        rope_factors: torch.Tensor | None,
        kv_layer: int,
    ) -> None:
        super().__init__()
        self.eps = cfg.rms_eps
        self.add_norm = w.ops.add_rms_norm_int8
        self.attn_norm = w.vector(f"blk.{layer}.attn_norm.weight", cfg.d_model)
        self.attn = Attention(cfg, w, layer, rope_factors, kv_layer)
        self.ffn_norm = w.vector(f"blk.{layer}.ffn_norm.weight", cfg.d_model)
        self.mlp = GatedMLP(cfg, w, layer, gelu=False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        kv: KVPool,
        ahead: dict | None = None,
        nxt: tuple[torch.Tensor, object] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
        """Takes the previous layer's MLP output and the residual stream before it (None at the
        first layer) and returns the same pair, so each residual add fuses with the RMSNorm
        that follows it (one kernel on the GPU instead of two). At batch 1 that kernel also
        rounds its output to int8 for the GEMVs that read it (ops.add_rms_norm_int8).

        At batch 1 on the rows GEMVs the add and norm go into the GEMV before them instead
        (``norm_ahead``, no launch of their own): the output projection's for the MLP's norm,
        and the down projection's for the norm after the layer, nxt: (its weight, the module
        that reads it: the next layer's attention, or the LM head after the last). Then the third
        value returned is that rounding (else None), the residual already holds the MLP's
        output, and the next layer takes it as ``ahead``."""
        m = x.shape[0]
        if ahead is None:
            layouts = self.attn.int8_layouts(m)
            h, residual, rounded = self.add_norm(x, residual, self.attn_norm, self.eps, layouts)
        else:  # every Q/K/V GEMV reads the rounding: the residual stands in for the normed row
            h, rounded = residual, ahead
        fold = self._fold(residual, self.ffn_norm, self.mlp, m)
        a, folded = self.attn.forward_fold(h, batch, kv, rounded, fold)
        if folded is None:
            layouts = self.mlp.int8_layouts(m)
            h, residual, rounded = self.add_norm(a, residual, self.ffn_norm, self.eps, layouts)
        else:
            residual, rounded = folded
            h = residual
        fold = self._fold(residual, *nxt, m) if nxt is not None else None
        out, folded = self.mlp.forward_fold(h, rounded, fold)
        if folded is None:
            return out, residual, None
        return out, folded[0], folded[1]

    def _fold(
        self, residual: torch.Tensor | None, weight: torch.Tensor, reader: nn.Module, m: int
    ) -> tuple | None:
        """(residual, norm weight, eps, layouts) for the GEMV before `reader` (the attention,
        the MLP or the LM head) to add and norm in its epilogue, when every GEMV of the reader
        reads only the rounding; else None."""
        if residual is None or not reader.reads_rounded(m):
            return None
        return residual, weight, self.eps, reader.int8_layouts(m)


class LlamaForCausalLM(CausalLM):
    residual_stream = True

    def run_modules(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        ahead = None
        last = len(self.layers) - 1
        # after the last layer, the final norm for the LM head when it reads every row (a
        # pipeline stage hands its last layer's output on unnormed)
        head = (self.norm, _Head(self)) if batch.all_rows and self.whole else None
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1] if i < last else None
            nxt = (nxt.attn_norm, nxt.attn) if nxt is not None else head
            x, residual, ahead = layer(x, residual, batch, kv, ahead, nxt)
        return x, residual, ahead

    def make_layer(self, cfg: ModelConfig, w: WeightLoader, layer: int, kv_layer: int) -> nn.Module:
        return LlamaLayer(cfg, w, layer, self.rope_factors, kv_layer)


class _Head:
    """The LM head as a reader of the final norm (LlamaLayer._fold): it reads only the norm's
    rounding where it takes one row in an int8 layout (CausalLM.head_layouts)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def int8_layouts(self, m: int) -> tuple[tuple[int, int], ...]:
        return self.model.head_layouts(m)

    def reads_rounded(self, m: int) -> bool:
        return m == 1 and bool(self.model.head_layouts(1))
