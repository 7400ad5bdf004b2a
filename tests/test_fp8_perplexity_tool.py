"""tools/fp8_perplexity.py: the perplexity ratio and KL divergence it reports are zero for a
cache that quantizes nothing, and the KL divergence is positive for an FP8 cache."""

from __future__ import annotations

import pytest
import torch

import tools.fp8_perplexity as tool
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf


def test_compare_measures_the_fp8_perturbation(tmp_path, monkeypatch) -> None:
    spec = SynthSpec("llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=32,
                     ffn_dim=128, vocab=320, seed=7)  # fmt: skip
    path = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    modes = {"same": {"kv_dtype": torch.float16}, **tool.MODES}
    monkeypatch.setattr(tool, "MODES", modes)
    windows = [[(7 * i + 3) % 320 for i in range(40)], [(11 * i + 5) % 320 for i in range(40)]]
    ppl, out = tool.compare(path, windows)
    assert ppl > 1
    assert out["same"] == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.0, abs=1e-12))
    for mode in ("token", "head"):
        ratio, kl = out[mode]
        assert kl > 0 and abs(ratio) < 0.5
