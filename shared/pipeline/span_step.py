"""A pipeline stage's layers as one step of the model's call shape, for CUDA graphs.

``SpanStep(batch, kv, out)`` runs the stage's decoder layers and writes their output rows into
``out`` [rows, 2 * d_model] in the activations' dtype: x, then the residual stream beside it
(architectures that hand one on, ``CausalLM.residual_stream``; else that half is left as it
is). The first stage embeds the batch's tokens; a later stage reads the previous stage's rows
from ``x_in`` and ``residual_in``, static buffers the caller fills before each step (``load``),
as a captured graph reads its inputs. ``StepGraphs`` captures it at decode buckets like the
whole model: a stage's eager step launches a few hundred kernels from Python, which at small
batches cost more than running them.
"""

from __future__ import annotations

import torch

from shared.kv import KVPool
from shared.model.batch import ForwardBatch
from shared.model.causal_lm import CausalLM


class SpanStep:
    def __init__(
        self,
        model: CausalLM,
        max_tokens: int,
        first: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """first: the stage holding the embedding (it embeds the tokens; no inputs). dtype:
        the activations' (what the layers take and hand on)."""
        self.model = model
        self.cfg = model.cfg
        self.first = first
        self.width = model.cfg.d_model
        self.out_width = 2 * self.width
        self.out_dtype = dtype
        self.x_in = self.residual_in = None  # contiguous: the kernels read rows whole
        if not first:
            self.x_in = torch.zeros(max_tokens, self.width, dtype=dtype, device=device)
            self.residual_in = torch.zeros_like(self.x_in)

    @property
    def carries_residual(self) -> bool:
        return self.model.residual_stream

    def load(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """The previous stage's rows into the inputs a step reads."""
        n = x.shape[0]
        self.x_in[:n].copy_(x)
        if residual is not None:
            self.residual_in[:n].copy_(residual)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual or None) of a step's output rows."""
        d = self.width
        return out[:, :d], (out[:, d:] if self.carries_residual else None)

    def __call__(
        self, batch: ForwardBatch, kv: KVPool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        n, d = batch.token_ids.shape[0], self.width
        if self.first:
            x, residual = self.model.embed_batch(batch), None
        else:
            x = self.x_in[:n]
            residual = self.residual_in[:n] if self.carries_residual else None
        x, residual, _ = self.model.run_layers(x, residual, batch, kv)
        if out is None:
            out = torch.empty(n, self.out_width, dtype=self.out_dtype, device=x.device)
        out[:, :d].copy_(x)
        if residual is not None:
            out[:, d:].copy_(residual)
        return out
