"""Per-head FP8 KV scales calibrated at start (shared.kv.calibrate), on a real model (CPU)."""

from __future__ import annotations

import pytest
import torch

from shared.kv import KVPool
from shared.kv.calibrate import HEADROOM, TEXT, calibrate, calibrate_head_scales
from shared.loader import GGUFFile
from shared.model import ForwardBatch, SeqChunk, load_model
from shared.tokenizer import load_tokenizer

FP8 = torch.float8_e4m3fn
BLOCK = 16


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    f = GGUFFile(smollm2_path)
    return load_model(f, "cpu"), load_tokenizer(f.metadata)


def _pool(model, n_blocks: int, scales: str) -> KVPool:
    c = model.cfg
    return KVPool(c.n_layers, n_blocks, BLOCK, c.n_kv_heads, c.head_dim, FP8, "cpu", scales)


def test_calibrated_scales_leave_headroom_on_their_own_text(smollm2) -> None:
    model, tok = smollm2
    ids = tok.encode(TEXT.read_text())
    assert len(ids) > 400
    n_blocks = -(-len(ids) // BLOCK)
    kv = _pool(model, n_blocks, "head")
    calibrate(model, kv, tok)
    for store in kv.k_scale_store + kv.v_scale_store:
        assert store.shape == (model.cfg.n_kv_heads,)
        assert torch.isfinite(store).all() and (store > 0).all()
        assert not torch.equal(store, torch.ones_like(store)), "a layer kept the initial scales"
    # the same text written under the calibrated scales: its largest codes sit near 448 / HEADROOM
    batch = ForwardBatch.build([SeqChunk(ids, 0, list(range(n_blocks)), "last")], BLOCK, "cpu")
    with torch.inference_mode():
        model(batch, kv)
    for cache in kv.k + kv.v:
        codes = cache.reshape(-1, cache.shape[-1])[: len(ids)].float().abs()
        assert codes.isfinite().all()
        assert 0.7 * 448 / HEADROOM < codes.max() < 1.3 * 448 / HEADROOM


def test_headroom_scales_linearly(smollm2) -> None:
    model, tok = smollm2
    ids = tok.encode("The fog comes in all at once, and the bells go soft.")
    one, two = _pool(model, 2, "head"), _pool(model, 2, "head")
    calibrate_head_scales(model, one, ids, headroom=1.0)
    calibrate_head_scales(model, two, ids, headroom=2.0)
    ones, twos = one.k_scale_store + one.v_scale_store, two.k_scale_store + two.v_scale_store
    for a, b in zip(ones, twos, strict=True):
        torch.testing.assert_close(b, 2 * a, rtol=0, atol=0)


def test_calibration_needs_a_head_scaled_fp8_pool(smollm2) -> None:
    model, _ = smollm2
    with pytest.raises(ValueError, match="scales='head'"):
        calibrate_head_scales(model, _pool(model, 2, "token"), [1, 2, 3])
    with pytest.raises(ValueError, match="at least one token"):
        calibrate_head_scales(model, _pool(model, 2, "head"), [])
    with pytest.raises(ValueError, match="one of token, head"):
        _pool(model, 2, "tensor")


def test_engine_calibrates_and_generates(smollm2_path) -> None:
    """build_engine with fp8 and per-head scales: a calibrated pool, and greedy output that
    follows fp16 KV's (measured: the first 11 of 12 tokens on one machine; on another, whose
    CPU kernels round float16 otherwise, the first 4, then a near-tie that FP8 rounding flips,
    at every commit back to 1cc07d8: 4 are asserted)."""
    from shared.engine import Sequence
    from shared.engine.factory import EngineConfig, build_engine
    from shared.sampling import SamplingParams

    outputs = {}
    for kv_dtype, scales in (("float16", "token"), ("fp8", "head")):
        loaded = build_engine(
            EngineConfig(
                model_path=str(smollm2_path), kv_dtype=kv_dtype, kv_scales=scales, kv_blocks=64
            )
        )
        kv = loaded.engine.runner.kv
        assert kv.head_scales == (scales == "head")
        prompt = loaded.tokenizer.encode("The harbour office posts the tide table by the door")
        seq = Sequence(1, prompt, SamplingParams(temperature=0.0).validate(), 12, frozenset(), None)
        loaded.engine.add(seq)
        tokens = []
        while loaded.engine.has_work():
            tokens += [e.token_id for e in loaded.engine.step()]
        outputs[kv_dtype] = tokens
    assert len(outputs["fp8"]) == 12
    assert outputs["fp8"][:4] == outputs["float16"][:4]
