"""Builds the right CausalLM for a GGUF file on a device."""

from __future__ import annotations

import torch

from shared.loader import GGUFFile
from shared.model.causal_lm import CausalLM, LayerSpan
from shared.model.config import ModelConfig
from shared.model.dense_copies import add_dense_copies
from shared.model.gemma3 import Gemma3ForCausalLM
from shared.model.llama import LlamaForCausalLM
from shared.model.ops_choice import ops_for
from shared.model.weights import WeightLoader, tune_linears

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}

# the CPU's forms of quantized linears (load_model's cpu_weights)
CPU_WEIGHTS = ("native", "int4", "float")


def load_model(
    f: GGUFFile,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    cache_dequantized: bool | None = None,
    ops: str = "auto",
    dense_copies: str = "off",
    cpu_weights: str = "float",
    span: LayerSpan | None = None,
) -> CausalLM:
    """`cache_dequantized` defaults to True on the CPU, where per-call dequantization dominates;
    `ops` picks the op implementations: "auto" (Triton on CUDA), "torch" or "triton";
    `dense_copies` (auto / on / off): dense copies of packed weights beside them for batches of
    more than 16 rows (shared.model.dense_copies); `cpu_weights`: on the CPU, quantized linears
    kept as their GGUF blocks for the compiled matmuls ("native", shared.model.native_linear),
    as 4-bit planes for torch's int4 GEMM ("int4", shared.model.int4_linear), or as float
    copies ("float"); `span`: a pipeline stage's layers (and
    ends), only their tensors read."""
    cfg = ModelConfig.from_gguf(f)
    if cache_dequantized is None:
        cache_dequantized = torch.device(device).type == "cpu"
    w = WeightLoader(f, device, compute_dtype, cache_dequantized, ops_for(device, ops), cpu_weights)
    model = ARCHITECTURES[cfg.arch](cfg, w, span).eval()
    tune_linears(model)
    add_dense_copies(model, dense_copies)
    return model
