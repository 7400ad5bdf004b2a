"""The model with Triton ops (fused RoPE + KV write, paged attention, norms, activations) gives
the logits of the torch-reference ops, teacher-forced and decoding through the engine. Runs
natively on CUDA, or on the CPU under TRITON_INTERPRET=1 with tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.engine import LLMEngine, Sequence
from shared.engine.model_runner import ModelRunner
from shared.kv import BlockManager, KVPool
from shared.loader import GGUFFile
from shared.model import ForwardBatch, SeqChunk, load_model
from shared.ops.paged_attention_fp8 import FP8
from shared.sampling import SamplingParams
from tests.spies import record_results
from tools.synthetic_gguf import SynthSpec, write_synthetic_gguf

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

SPECS = {
    "llama": SynthSpec("llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=32,
                       ffn_dim=128, vocab=320, seed=7),
    "qwen3": SynthSpec("qwen3", n_layers=2, d_model=64, n_heads=4, n_kv_heads=1, head_dim=32,
                       ffn_dim=128, vocab=320, seed=7),
    "gemma3": SynthSpec("gemma3", n_layers=6, d_model=64, n_heads=2, n_kv_heads=1, head_dim=64,
                        ffn_dim=128, vocab=320, sliding_window=8, seed=7),
}  # fmt: skip
BLOCK = 8


@pytest.fixture(scope="module", params=list(SPECS))
def path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("tm") / "m.gguf", SPECS[request.param])


def logits(
    path: Path, ops: str, ids: list[int], chunk: int, kv_dtype: torch.dtype, head_scales=None,
    model=None,
) -> np.ndarray:  # fmt: skip
    """head_scales: per layer (k, v) [n_kv_heads] scales of an FP8 cache with per-head scales;
    model: the one loaded from path (else loaded here with `ops`)."""
    model = model or load_model(GGUFFile(path, cache_dir=path.parent), DEVICE, ops=ops)
    cfg = model.cfg
    n_blocks = -(-len(ids) // BLOCK) + 1
    scales = "head" if head_scales is not None else "token"
    kv = KVPool(
        cfg.n_layers, n_blocks, BLOCK, cfg.n_kv_heads, cfg.head_dim, kv_dtype, DEVICE, scales
    )
    for layer, (k, v) in enumerate(head_scales or []):
        kv.k_scale_store[layer].copy_(k)
        kv.v_scale_store[layer].copy_(v)
    table = list(range(n_blocks))[::-1]  # non-contiguous on purpose
    out = []
    for start in range(0, len(ids), chunk):
        batch = ForwardBatch.build(
            [SeqChunk(ids[start : start + chunk], start, table, "all")], BLOCK, DEVICE
        )
        out.append(model(batch, kv).float().cpu().numpy())
    return np.concatenate(out)


@pytest.mark.parametrize("chunk", [40, 13])
def test_triton_ops_match_torch_ops(path: Path, chunk: int) -> None:
    ids = [1] + np.random.default_rng(0).integers(3, 320, 39).tolist()
    ref = logits(path, "torch", ids, chunk, torch.float32)
    got = logits(path, "triton", ids, chunk, torch.float32)
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.97


def _generate(path: Path, ops: str) -> list[list[int]]:
    model = load_model(GGUFFile(path, cache_dir=path.parent), DEVICE, ops=ops)
    cfg = model.cfg
    kv = KVPool(cfg.n_layers, 40, BLOCK, cfg.n_kv_heads, cfg.head_dim, torch.float32, DEVICE)
    engine = LLMEngine(ModelRunner(model, kv, DEVICE), BlockManager(40, BLOCK), 256, 24)
    rng = np.random.default_rng(1)
    seqs = [
        Sequence(i, [1] + rng.integers(3, 320, n).tolist(), SamplingParams(temperature=0), 6)
        for i, n in enumerate((3, 11, 25))
    ]
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    return [s.output_ids for s in seqs]


def test_engine_decode_with_triton_ops_matches_torch(path: Path) -> None:
    assert _generate(path, "triton") == _generate(path, "torch")


def test_chunk_split_k_matches_torch_ops(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks over a cached prefix with attention split-K (thresholds lowered to this
    tiny model: a prefix of 8 keys counts as long, a slice needs 8 keys, 64 SMs to fill)."""
    import shared.kernels.attention_plan as plan
    import shared.kernels.device as device_k
    import shared.kernels.paged_attention as pa

    chosen = record_results(monkeypatch, pa, "chunk_num_splits")
    for module in (pa, plan):  # the wrapper's windowed-layer test reads pa's
        monkeypatch.setattr(module, "CHUNK_SPLIT_MIN_CONTEXT", 8)
    monkeypatch.setattr(plan, "_CHUNK_SPLIT_MIN_KEYS", 8)
    monkeypatch.setattr(device_k, "num_sms", lambda device: 64)
    ids = [1] + np.random.default_rng(0).integers(3, 320, 39).tolist()
    ref = logits(path, "torch", ids, 13, torch.float32)
    got = logits(path, "triton", ids, 13, torch.float32)
    assert max(chosen) > 1
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["token", "head"])
def test_fp8_kv_triton_ops_match_torch_ops(path: Path, scales: str) -> None:
    """An FP8 cache through the Triton write and attention kernels (per-token scales, or fixed
    per-head ones: FIXED_SCALES and HEAD_SCALES) gives the torch-reference ops' logits. CUDA
    only: the interpreter's fp32 -> fp8 cast rounds wrongly (test_kernels_fused)."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with fp8 (sm_89+)")
    from shared.kv.calibrate import calibrate_head_scales

    ids = [1] + np.random.default_rng(0).integers(3, 320, 39).tolist()
    head = None
    if scales == "head":
        model = load_model(GGUFFile(path, cache_dir=path.parent), DEVICE, ops="torch")
        c = model.cfg
        kv = KVPool(c.n_layers, 8, BLOCK, c.n_kv_heads, c.head_dim, FP8, DEVICE, "head")
        calibrate_head_scales(model, kv, ids[:20])  # not the whole text: some values saturate
        head = list(zip(kv.k_scale_store, kv.v_scale_store, strict=True))
    ref = logits(path, "torch", ids, 13, FP8, head)
    got = logits(path, "triton", ids, 13, FP8, head)
    np.testing.assert_allclose(got, ref, atol=3e-2 * np.abs(ref).max(), rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_tied_embedding_looks_up_the_heads_planes(tmp_path: Path) -> None:
    """A tied Q8_0 output: the packed embedding borrows the head's planes (one copy on the
    device) and the logits still match the torch ops'."""
    spec = SynthSpec("gemma3", n_layers=2, d_model=256, n_heads=2, n_kv_heads=1, head_dim=64,
                     ffn_dim=128, vocab=320, sliding_window=8, seed=3, untied=False,
                     embd_q8_0=True)  # fmt: skip
    path = write_synthetic_gguf(tmp_path / "tied.gguf", spec)
    model = load_model(GGUFFile(path, cache_dir=tmp_path), DEVICE, ops="triton",
                       cache_dequantized=False)  # fmt: skip
    assert model.embed.raw is None and model.embed.packed is model.lm_head.packed
    ids = [1] + np.random.default_rng(1).integers(3, 320, 19).tolist()
    ref = logits(path, "torch", ids, 20, torch.float32)
    got = logits(path, "triton", ids, 20, torch.float32, model=model)
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max(), rtol=0)
