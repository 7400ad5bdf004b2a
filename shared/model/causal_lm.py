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

    def run_layers(
        self, x: torch.Tensor, batch: ForwardBatch, kv: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        """(x, residual, rounded): the last layer's output and the residual stream it adds to
        (None: x is the stream); with rounded (the LM head's int8 rounding of the final norm,
        made in the last GEMV's epilogue) the residual holds the stream and stands in for the
        normed rows, which the head does not read."""
        for layer in self.layers:
            x = layer(x, batch, kv)
        return x, None, None

    def head_layouts(self, m: int) -> tuple[tuple[int, int], ...]:
        """The int8 layout the LM head reads m rows in, when they may be rounded ahead."""
        if (lay := self.lm_head.int8_layout(m)) is None:
            return ()
        return (lay,)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the rows `batch.logits_rows`; with `out` ([N,
        vocab] float32) written there (a CUDA graph's shared logits buffer)."""
        cfg = self.cfg
        x = self.embed(batch.token_ids)
        if (scale := self.embed_scale()) != 1.0:
            x = x * scale
        x, residual, rounded = self.run_layers(x, batch, kv)
        if rounded is not None:  # normed and rounded already: the stream stands in for h
            h = residual
        else:
            # a decode step's final norm reads x whole (every row is a logits row): no gather
            if not batch.all_rows:
                x = x[batch.logits_rows]
                residual = residual[batch.logits_rows] if residual is not None else None
            # the last residual add, the final norm and the LM head's int8 rounding in one launch
            layouts = self.head_layouts(x.shape[0])
            h, _, rounded = self.ops.add_rms_norm_int8(x, residual, self.norm, cfg.rms_eps, layouts)
        if out is None:
            n = self.lm_head.shape[0]
            out = torch.empty(h.shape[0], n, dtype=torch.float32, device=h.device)
        # float32 logits stored by the LM head itself (the rows GEMV, into a CUDA graph's buffer),
        # not rounded to the activations' dtype and converted by a launch of their own
        self.lm_head(h, rounded or None, out=out)
        if cfg.final_logit_softcap:
            c = cfg.final_logit_softcap
            out.div_(c).tanh_().mul_(c)
        return out
