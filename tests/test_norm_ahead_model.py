"""The residual add and RMSNorm folded into the batch-1 GEMVs inside the model
(``LlamaLayer.forward``, ``QuantLinear.forward_norm``; the kernels:
tests/test_kernel_norm_ahead.py).

A synthetic two-layer Llama quantized by llama.cpp, its planes interleaved as CUDA keeps them,
is run with the Triton ops over a prompt chunk and then token by token, with the fold and with
every GEMV declining it (``forward_norm`` None, as where it cannot fold): the one-token steps
launch the add + RMSNorm only for the first layer's attention norm (the output projections and
the down projections do the rest, the last one the final norm with the LM head's rounding), the
prompt chunk for every norm; the steps' logits are no farther from the float32 CPU reference
than the norm launches' (the folded rounding's codes come from float32 ``h * w``, the norm's
from its bf16 output). Q4_K_M (a Q4_K + Q6_K pair launch for Q/K/V in some layers) under
TRITON_INTERPRET=1 (``-m exhaustive``) and natively on CUDA; Q8_0 on CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import shared.model.linear as linear
from shared.kv import KVPool
from shared.loader import GGUFFile
from shared.model import load_model
from tests.interleaved_model import DEVICE, decode_logits, load_interleaved
from tests.oracle import skiff_logits
from tools.synthetic_gguf import SynthSpec, synthetic

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
# small for the interpreter: two layers (the down projection folds the next layer's norm)
SPEC = SynthSpec("llama", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                 ffn_dim=256, vocab=320, seed=4)  # fmt: skip
PROMPT, STEPS = 2, 2


def _decode(path: Path, fold: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, list]:
    """(the logits of a prompt chunk and STEPS one-token steps, the rows of each add + RMSNorm
    launch that ran: the layers', then the final norm's)."""
    with monkeypatch.context() as patch:
        if not fold:  # every GEMV declines the fold, as where it cannot: the norm launches
            patch.setattr(linear.QuantLinear, "forward_norm", lambda self, *a: None)
        model = load_interleaved(path)
        launches: list[int] = []
        for layer in model.layers:
            real = layer.add_norm
            layer.add_norm = lambda x, *a, real=real: launches.append(x.shape[0]) or real(x, *a)
        final: list[int] = []
        real = model.ops.add_rms_norm_int8
        model.ops.add_rms_norm_int8 = lambda x, *a: final.append(x.shape[0]) or real(x, *a)
        ids = [1] + np.random.default_rng(6).integers(3, SPEC.vocab, PROMPT + STEPS - 1).tolist()
        return decode_logits(model, ids, PROMPT), launches + ["final"] + final


# Natively only (the GPU suite runs the exhaustive tier): under the interpreter one case took
# 6-15 minutes of a CI core. On the CPU the epilogue's kernels run in test_kernel_norm_ahead.py
# (every weight type, both splits)
@pytest.mark.parametrize(
    "ftype",
    [
        pytest.param("Q4_K_M", marks=pytest.mark.exhaustive),
        pytest.param("Q8_0", marks=pytest.mark.skipif(DEVICE == "cpu", reason="CUDA only")),
    ],
)
def test_decode_with_the_fold_agrees_with_the_norm_launches(
    ftype: str, synthetic_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = synthetic(SPEC, ftype, synthetic_dir)
    apart, apart_launches = _decode(path, False, monkeypatch)
    got, launches = _decode(path, True, monkeypatch)
    norms = 2 * SPEC.n_layers
    # the final norm and the LM head's rounding: the last down projection's epilogue at one token
    final = ["final", PROMPT]
    assert apart_launches == [PROMPT] * norms + [1] * norms * STEPS + final + [1] * STEPS
    assert launches == [PROMPT] * norms + [1] * STEPS + final
    np.testing.assert_array_equal(got[:PROMPT], apart[:PROMPT])  # the same launches
    # the one-token steps, against the float32 CPU reference: the fold no farther from it than
    # the norm launches (bf16 activations, int8 roundings: both about 4 % of the largest logit
    # for Q4_K_M), and the two within that of each other
    ids = [1] + np.random.default_rng(6).integers(3, SPEC.vocab, PROMPT + STEPS - 1).tolist()
    ref = skiff_logits(path, ids, "cpu")[PROMPT:]
    scale = np.abs(ref).max()
    err_apart = np.abs(apart[PROMPT:] - ref).max()
    err = np.abs(got[PROMPT:] - ref).max()
    assert err <= 1.2 * err_apart + 0.005 * scale, (err, err_apart, scale)
    assert np.abs(got - apart).max() < 0.06 * scale


def _generate(path: Path, graphs: bool) -> tuple[list[int], int]:
    """One sequence's 24 greedy tokens through the engine (batch 1: the fold), with the decode
    steps replayed from CUDA graphs or eager: (the tokens, the decode replays)."""
    from shared.engine import Sequence
    from shared.engine.cuda_graphs import StepGraphs
    from shared.engine.engine import LLMEngine
    from shared.engine.model_runner import ModelRunner
    from shared.kv import BlockManager
    from shared.sampling import SamplingParams

    model = load_model(GGUFFile(path), DEVICE, torch.bfloat16)
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 64, 16, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16, DEVICE)
    g = None
    if graphs:
        g = StepGraphs(model, kv, max_seqs=4, max_model_len=512, max_batch_tokens=0)
        g.capture()
    engine = LLMEngine(ModelRunner(model, kv, DEVICE, g), BlockManager(64, 16), 512, 512, 4)
    ids = [1] + np.random.default_rng(7).integers(3, SPEC.vocab, 20).tolist()
    engine.add(Sequence(0, ids, SamplingParams(temperature=0), 24))
    out: list[int] = []
    while engine.has_work():
        out.extend(ev.token_id for ev in engine.step())
    return out, (g.replays["decode"] if g is not None else 0)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs")
def test_decode_graphs_with_the_fold_match_eager(synthetic_dir: Path) -> None:
    path = synthetic(SPEC, "Q4_K_M", synthetic_dir)
    graphs, replays = _generate(path, True)
    assert replays > 5
    assert graphs == _generate(path, False)[0]
