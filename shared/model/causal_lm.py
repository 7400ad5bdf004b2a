"""CausalLM: embedding → decoder layers over the paged KV cache → final norm → logits.

Architecture files subclass it with their layer type and embedding scale.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.config import ModelConfig
from shared.model.weights import WeightLoader

# decode steps' final norm reads x whole instead of through a gather of every row (a launch
# a step); off: the gather (tools/ab_w1 step-io-off)
WHOLE_ROWS = True


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = w.ops
        self.rope_factors = (
            w.vector("rope_freqs.weight", cfg.rope_dim // 2) if w.has("rope_freqs.weight") else None
        )
        self.embed = w.embedding(
            "token_embd.weight", cfg.vocab_size, cfg.d_model, cfg.tied_embeddings
        )
        self.layers = nn.ModuleList(self.make_layer(cfg, w, i) for i in range(cfg.n_layers))
        self.norm = w.vector("output_norm.weight", cfg.d_model)
        if cfg.tied_embeddings:
            self.lm_head = w.tied_lm_head(self.embed)
        else:
            self.lm_head = w.linear("output", cfg.vocab_size, cfg.d_model)

    def make_layer(self, cfg: ModelConfig, w: WeightLoader, layer: int) -> nn.Module:
        raise NotImplementedError

    def embed_scale(self) -> float:
        return 1.0

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, batch, kv)
        return x

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the rows `batch.logits_rows`; with `out` ([N,
        vocab] float32) written there (one launch converts and copies them: a CUDA graph's
        shared logits buffer)."""
        cfg = self.cfg
        x = self.embed(batch.token_ids)
        if (scale := self.embed_scale()) != 1.0:
            x = x * scale
        x = self.run_layers(x, batch, kv)
        whole = batch.all_rows and WHOLE_ROWS
        x = self.ops.rms_norm(x if whole else x[batch.logits_rows], self.norm, cfg.rms_eps)
        logits = self.lm_head(x)
        if cfg.final_logit_softcap:
            c = cfg.final_logit_softcap
            logits = torch.tanh(logits.float() / c) * c
        if out is None:
            return logits.float()
        return out.copy_(logits)
