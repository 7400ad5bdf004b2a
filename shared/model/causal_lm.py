"""CausalLM: embedding → decoder layers over the paged KV cache → final norm → logits.

Architecture files subclass it with their layer type and embedding scale. A pipeline stage
builds the part its LayerSpan names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.config import ModelConfig
from shared.model.native_layers import NativeLayers
from shared.model.weights import WeightLoader


@dataclass(frozen=True)
class LayerSpan:
    """The part of a model one pipeline stage holds: decoder layers [first, last), and with
    `ends` the token embedding, the final norm and the LM head (the first stage, where a step's
    hidden states come back to be sampled)."""

    first: int
    last: int
    ends: bool

    def __post_init__(self) -> None:
        if not 0 <= self.first < self.last:
            raise ValueError(f"a stage holds at least one layer: [{self.first}, {self.last})")


class CausalLM(nn.Module):
    # whether run_layers hands on a residual stream beside x (a pipeline stage after the first
    # then takes one in): the architectures that fuse each residual add with the next norm
    residual_stream = False

    def __init__(self, cfg: ModelConfig, w: WeightLoader, span: LayerSpan | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = w.ops
        self.span = span or LayerSpan(0, cfg.n_layers, True)
        if self.span.last > cfg.n_layers:
            raise ValueError(f"layers [{self.span.first}, {self.span.last}) of {cfg.n_layers}")
        self.rope_factors = (
            w.vector("rope_freqs.weight", cfg.rope_dim // 2) if w.has("rope_freqs.weight") else None
        )
        first = self.span.first
        self.layers = nn.ModuleList(
            self.make_layer(cfg, w, i, i - first) for i in range(first, self.span.last)
        )
        self.embed = self.norm = self.lm_head = None
        if not self.span.ends:
            return
        self.embed = w.embedding(
            "token_embd.weight", cfg.vocab_size, cfg.d_model, cfg.tied_embeddings
        )
        self.norm = w.vector("output_norm.weight", cfg.d_model)
        if cfg.tied_embeddings:
            self.lm_head = w.tied_lm_head(self.embed)
        else:
            self.lm_head = w.linear("output", cfg.vocab_size, cfg.d_model)

    @property
    def whole(self) -> bool:
        """Whether this module holds every layer and both ends (no pipeline)."""
        return self.span.ends and self.span.first == 0 and self.span.last == self.cfg.n_layers

    def make_layer(self, cfg: ModelConfig, w: WeightLoader, layer: int, kv_layer: int) -> nn.Module:
        """Decoder layer `layer` of the file, its KV in the pool's layer `kv_layer` (a stage's
        pool holds its own layers only)."""
        raise NotImplementedError

    def embed_scale(self) -> float:
        return 1.0

    def run_layers(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        """(x, residual, rounded): the last layer's output and the residual stream it adds to
        (None: x is the stream); with rounded (the LM head's int8 rounding of the final norm,
        made in the last GEMV's epilogue) the residual holds the stream and stands in for the
        normed rows, which the head does not read. `residual` in: the previous stage's (None
        at the first layer). On the CPU, where the library takes every layer, in one call of
        it (shared.model.native_layers: the same values); else through the modules."""
        native = self._native_layers()
        if native is not None and native.usable(x, kv):
            return *native.run(x, residual, batch, kv), None
        return self.run_modules(x, residual, batch, kv)

    def run_modules(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        """run_layers through the layer modules (what the architecture files override)."""
        for layer in self.layers:
            x = layer(x, batch, kv)
        return x, None, None

    def _native_layers(self) -> NativeLayers | None:
        """The layers in the CPU library's one call, where they all qualify (built once)."""
        if "_native" not in self.__dict__:
            self.__dict__["_native"] = NativeLayers.build(self)
        return self.__dict__["_native"]

    def head_layouts(self, m: int) -> tuple[tuple[int, int], ...]:
        """The int8 layout the LM head reads m rows in, when they may be rounded ahead."""
        if (lay := self.lm_head.int8_layout(m)) is None:
            return ()
        return (lay,)

    def embed_batch(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's token embeddings (scaled as the architecture wants)."""
        x = self.embed(batch.token_ids)
        if (scale := self.embed_scale()) != 1.0:
            x = x * scale
        return x

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the rows `batch.logits_rows`; with `out` ([N,
        vocab] float32) written there (a CUDA graph's shared logits buffer)."""
        x, residual, rounded = self.run_layers(self.embed_batch(batch), None, batch, kv)
        return self.logits(x, residual, rounded, batch, out)

    def logits(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rounded: dict | None,
        batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm and the LM head over the last layer's (x, residual, rounded)."""
        cfg = self.cfg
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
