"""The batch-1 Q/K/V GEMV's RoPE epilogue inside the model (``Attention.forward``,
``SplitLinear.forward_rope``, ``TritonOps.qkv_rope``; the kernels: tests/test_kernel_qkv_rope.py).

A synthetic Llama quantized by llama.cpp, its planes interleaved as CUDA keeps them, is run with
the Triton ops over a prompt chunk and then token by token: its logits equal those of the same
model with RoPE and the KV write in a launch of their own (``forward_rope`` declining, as where
it cannot take them), and that launch runs only for the prompt chunk (the one-token steps take
the epilogue): Q4_K_M (Q4_K q/k) and Q8_0 (one fused Q/K/V weight). Under TRITON_INTERPRET=1 on
the CPU, natively on CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import shared.model.linear as linear
from tests.interleaved_model import DEVICE, decode_logits, load_interleaved
from tools.synthetic_gguf import SynthSpec, synthetic

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
# small for the interpreter (its int8 dot products dominate): one layer, K of one Q4_K chunk
SPEC = SynthSpec("llama", n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                 ffn_dim=256, vocab=320, seed=3)  # fmt: skip
PROMPT, STEPS = 2, 2
# the CPU tier (tests/tiers.py): Q8_0 (one fused Q/K/V weight). Q4_K_M's Q4_K + Q6_K pair
# launch with the epilogue runs on the CPU in test_kernel_qkv_rope.py and inside the model in
# test_norm_ahead_model.py
CPU_TIER = {"ftype": {"Q8_0"}}


def _decode(path: Path, fused: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, list]:
    """(the logits of a prompt chunk and STEPS one-token steps, the token counts of the RoPE +
    KV-write launches that ran)."""
    with monkeypatch.context() as patch:
        if not fused:  # the GEMV declines the epilogue: RoPE and the KV write apart
            patch.setattr(linear.SplitLinear, "forward_rope", lambda self, *a: None)
        model = load_interleaved(path)
        ops = model.layers[0].attn.ops
        launches, real = [], ops._rope_kv
        patch.setattr(ops, "_rope_kv", lambda q, *a: launches.append(q.shape[0]) or real(q, *a))
        ids = [1] + np.random.default_rng(5).integers(3, SPEC.vocab, PROMPT + STEPS - 1).tolist()
        return decode_logits(model, ids, PROMPT), launches


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_decode_with_the_epilogue_equals_rope_apart(
    ftype: str, synthetic_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = synthetic(SPEC, ftype, synthetic_dir)
    apart, apart_launches = _decode(path, False, monkeypatch)
    got, launches = _decode(path, True, monkeypatch)
    per_step = [PROMPT] * SPEC.n_layers + [1] * SPEC.n_layers * STEPS
    assert apart_launches == per_step
    assert launches == per_step[: SPEC.n_layers]
    if DEVICE == "cpu":
        np.testing.assert_array_equal(got, apart)
    else:  # the compiler may contract the rotation differently in the two kernels
        np.testing.assert_allclose(got, apart, atol=1e-2 * np.abs(apart).max(), rtol=0)
        assert (got.argmax(-1) == apart.argmax(-1)).all()
