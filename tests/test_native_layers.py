"""A Llama-family model's layers in one call of the CPU library (shared/model/native_layers.py
over shared/cpu/layers.c) against the modules' path it replaces, op by op: the same values bit
for bit, for SmolLM2 (Q4_1), a synthetic Q4_K_M llama (q/k and v of different types: two row
blocks of the fused projection) and Gemma 3 (QK-norm, norms after attention and the MLP, GELU,
sliding windows), a step of prompt chunks beside decode rows, float32 and float16 caches, and a
pipeline stage's span (the residual stream handed in). Float weights, or the library's layers
turned off, keep the modules' path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.cpu import native
from shared.kv import KVPool
from shared.loader import GGUFFile
from shared.model import load_model
from shared.model.batch import ForwardBatch, SeqChunk
from shared.model.causal_lm import LayerSpan
from shared.model.native_layers import NativeLayers
from tools.synthetic_gguf import SynthSpec, synthetic

if native.load() is None:
    pytest.skip("no CPU library (SKIFF_CPU_NATIVE=0 or no C compiler)", allow_module_level=True)

BLOCK = 16


def _batch(vocab: int) -> ForwardBatch:
    """A 21-token prompt chunk after 11 cached tokens, and two decode rows."""
    g = torch.Generator().manual_seed(3)
    chunks, first = [], 0
    for cached, new in ((11, 21), (40, 1), (7, 1)):
        ids = torch.randint(3, vocab, (new,), generator=g).tolist()  # the step's tokens
        blocks = -(-(cached + new) // BLOCK)
        chunks.append(SeqChunk(ids, cached, list(range(first, first + blocks)), "last"))
        first += blocks
    return ForwardBatch.build(chunks, BLOCK, "cpu")


def _pool(model, dtype: torch.dtype) -> KVPool:
    mc = model.cfg
    return KVPool(len(model.layers), 16, BLOCK, mc.n_kv_heads, mc.head_dim, dtype, "cpu")


def _both(model, batch: ForwardBatch, dtype: torch.dtype, x: torch.Tensor, residual=None):
    """(the library's (x, residual, KV), the modules' (x, residual, KV)) from the same pools."""
    got = []
    for fast in (True, False):
        kv = _pool(model, dtype)
        for t in (*kv.k, *kv.v):  # the cached prefix: the same random K/V in both
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)).to(dtype))
        model.__dict__["_native"] = NativeLayers.build(model) if fast else None
        assert (model._native_layers() is not None) == fast
        y, res, _ = model.run_layers(x.clone(), None if residual is None else residual.clone(),
                                     batch, kv)  # fmt: skip
        got.append((y, res, kv))
    return got


@pytest.fixture(scope="module")
def q4k_path(synthetic_dir: Path) -> Path:
    spec = SynthSpec(arch="llama", n_layers=4, d_model=512, n_heads=8, n_kv_heads=2,
                     ffn_dim=1024, vocab=1024)  # fmt: skip
    return synthetic(spec, "Q4_K_M", synthetic_dir)


@pytest.mark.parametrize("which", ["smollm2", "q4k", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_the_layers_in_one_call_equal_the_modules(which, dtype, request) -> None:
    path = request.getfixturevalue(f"{which}_path")
    model = load_model(GGUFFile(path), cpu_weights="native")
    batch = _batch(model.cfg.vocab_size)
    x = model.embed_batch(batch)
    (y1, r1, kv1), (y2, r2, kv2) = _both(model, batch, dtype, x)
    assert torch.equal(y1, y2)
    if which == "gemma3":  # x is its only stream
        assert r1 is None and r2 is None
    else:
        assert torch.equal(r1, r2)
    for a, b in zip((*kv1.k, *kv1.v), (*kv2.k, *kv2.v), strict=True):
        assert torch.equal(a, b)
    if which == "q4k":  # the fused Q/K/V of two types: two row blocks
        assert any(len(layer[1]) == 2 for layer in NativeLayers.build(model)._layers)


def test_a_later_stage_takes_the_residual_stream(smollm2_path: Path) -> None:
    model = load_model(GGUFFile(smollm2_path), cpu_weights="native", span=LayerSpan(10, 30, False))
    batch = _batch(model.cfg.vocab_size)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(batch.token_ids.shape[0], model.cfg.d_model, generator=g)
    residual = torch.randn(x.shape, generator=g)
    (y1, r1, _), (y2, r2, _) = _both(model, batch, torch.float16, x, residual)
    assert torch.equal(y1, y2) and torch.equal(r1, r2)


def test_models_it_does_not_take_keep_the_modules(
    smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKIFF_CPU_LAYERS", "0")
    assert NativeLayers.build(load_model(GGUFFile(smollm2_path), cpu_weights="native")) is None
    monkeypatch.delenv("SKIFF_CPU_LAYERS")
    float_model = load_model(GGUFFile(smollm2_path))  # cpu_weights "float"
    assert NativeLayers.build(float_model) is None  # projections not from their blocks
