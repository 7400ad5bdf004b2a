"""RoPE + KV write into an FP8 (e4m3) cache against the torch reference: per-token scales
(computed and written with each token) and fixed per-head scales (read, never written). The fp8
payloads are compared on CUDA only (`-m gpu`). Helpers and the interpreter / GPU selection:
tests/test_kernels_fused.py."""

from __future__ import annotations

import pytest
import torch

from shared.kernels.rope_kv import rope_and_write_kv
from shared.ops.paged_attention_fp8 import FP8 as FP8_DTYPE
from shared.ops.rope_kv import rope_and_write_kv_ref
from tests.test_kernels_fused import (
    ANGLE_RTOL,
    DEVICE,
    _assert_rope_close,
    _randn,
    _slots,
    _split_qkv,
)


def _fp8_case(n_tok: int, n_heads: int, n_kv: int, d: int, dtype: torch.dtype) -> dict:
    """Runs kernel and reference on poisoned fp8 caches and scale caches; returns all tensors."""
    q, k, v = _split_qkv(n_tok, n_heads, n_kv, d, dtype, seed=10)
    k[1, 0].zero_()  # an all-zero head: its scale falls back to 1
    block_size = 16
    num_blocks = 2 * -(-n_tok // block_size) + 2
    g = torch.Generator().manual_seed(11)
    positions = torch.randint(0, 2048, (n_tok,), generator=g).to(DEVICE)
    slots = _slots(n_tok, num_blocks, block_size, start=3, seed=12)
    shape = (num_blocks, block_size, n_kv)
    before = [_randn(*shape, d, seed=s).to(FP8_DTYPE) for s in (13, 14)]
    before += [_randn(*shape, seed=s).abs() for s in (15, 16)]  # k_scale, v_scale
    got, want = [c.clone() for c in before], [c.clone() for c in before]
    common = (positions, d, 1e4, True, 1.0, None)
    q_out = rope_and_write_kv(q, k, v, *_fp8_args(common, got, slots))
    q_want = rope_and_write_kv_ref(q, k, v, *_fp8_args(common, want, slots))
    return dict(q=q, k=k, v=v, theta=positions.double(), slots=slots, before=before, got=got,
                want=want, q_out=q_out, q_want=q_want)  # fmt: skip


def _fp8_args(common: tuple, caches: list[torch.Tensor], slots: torch.Tensor) -> tuple:
    positions, rope_dim, base, neox, scale, ff = common
    k_cache, v_cache, k_scale, v_scale = caches
    return (positions, k_cache, v_cache, slots, rope_dim, base, neox, scale, ff, k_scale, v_scale)


def test_rope_and_write_kv_fp8_scales() -> None:
    """FP8 cache: q, the per-(token, kv head) scales, and untouched slots (runs everywhere)."""
    c = _fp8_case(7, 4, 2, 64, torch.float32)
    _assert_rope_close(c["q_out"], c["q_want"], c["q"], c["theta"], torch.float32, "q")
    live = c["slots"][c["slots"] >= 0]
    written = torch.zeros(c["got"][0].shape[:2].numel(), dtype=torch.bool, device=DEVICE)
    written[live] = True
    for i in range(4):  # k values, v values, k scales, v scales: untouched rows bit-identical
        got, before = (x.view(torch.uint8).flatten(0, 1) for x in (c["got"][i], c["before"][i]))
        assert torch.equal(got[~written], before[~written]), f"cache {i} changed outside slots"
    # amax of rotated k moves with the angle error; v's amax is exact
    k_rtol = 1e-5 + ANGLE_RTOL * c["theta"].max().item() * 2
    for i, rtol in ((2, k_rtol), (3, 1e-6)):
        got, want = c["got"][i].flatten(0, 1)[live], c["want"][i].flatten(0, 1)[live]
        torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    zero_head_scale = c["got"][2].flatten(0, 1)[c["slots"][1], 0]
    assert zero_head_scale.item() == 1.0


FP8_INTERPRETER = (
    "the Triton interpreter's fp32 -> fp8e4nv cast loses the mantissa carry when rounding up "
    "(31.85 -> 16), so fp8 payloads are compared on CUDA only"
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=FP8_INTERPRETER)
def test_rope_and_write_kv_fp8_values() -> None:
    c = _fp8_case(300, 32, 8, 128, torch.bfloat16)
    live = c["slots"][c["slots"] >= 0]
    for i in (0, 1):  # k, v
        got, want = c["got"][i].flatten(0, 1)[live], c["want"][i].flatten(0, 1)[live]
        scale = c["want"][i + 2].flatten(0, 1)[live][..., None]
        # the same fp8 code almost everywhere; one step apart where the scaled value sits on a
        # rounding boundary (angle error, division rounding)
        same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
        assert same > 0.97, f"only {same:.3f} of fp8 codes match"
        torch.testing.assert_close(got.float() * scale, want.float() * scale, rtol=0.13, atol=1e-3)


def _fp8_head_case(n_tok: int, n_heads: int, n_kv: int, d: int, dtype: torch.dtype) -> dict:
    """Kernel and reference writing an fp8 cache under one fixed scale per KV head (block and
    slot strides 0), the scales low enough that some values saturate at ±448."""
    q, k, v = _split_qkv(n_tok, n_heads, n_kv, d, dtype, seed=20)
    block_size = 16
    num_blocks = -(-n_tok // block_size) + 2
    g = torch.Generator().manual_seed(21)
    positions = torch.randint(0, 2048, (n_tok,), generator=g).to(DEVICE)
    slots = _slots(n_tok, num_blocks, block_size, start=5, seed=22)
    shape = (num_blocks, block_size, n_kv)
    before = [_randn(*shape, d, seed=s).to(FP8_DTYPE) for s in (23, 24)]
    per_head = [torch.tensor([0.004, 0.011][:n_kv], device=DEVICE) for _ in range(2)]
    got, want = [c.clone() for c in before], [c.clone() for c in before]
    common = (positions, d, 1e4, True, 1.0, None)
    scales = [s.expand(shape) for s in per_head]
    q_out = rope_and_write_kv(q, k, v, *_fp8_args(common, got + scales, slots))
    q_want = rope_and_write_kv_ref(q, k, v, *_fp8_args(common, want + scales, slots))
    return dict(q=q, theta=positions.double(), slots=slots, before=before, got=got, want=want,
                q_out=q_out, q_want=q_want, per_head=per_head)  # fmt: skip


def test_rope_and_write_kv_fp8_head_scales() -> None:
    """Fixed per-head scales: read, never written; q right; slots outside the batch untouched."""
    c = _fp8_head_case(7, 4, 2, 64, torch.float32)
    _assert_rope_close(c["q_out"], c["q_want"], c["q"], c["theta"], torch.float32, "q")
    for s in c["per_head"]:  # read, never written
        assert torch.equal(s, torch.tensor([0.004, 0.011], device=DEVICE))
    live = c["slots"][c["slots"] >= 0]
    written = torch.zeros(c["got"][0].shape[:2].numel(), dtype=torch.bool, device=DEVICE)
    written[live] = True
    for got, before in zip(c["got"], c["before"], strict=True):
        got, before = (x.view(torch.uint8).flatten(0, 1) for x in (got, before))
        assert torch.equal(got[~written], before[~written]), "cache changed outside slots"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=FP8_INTERPRETER)
def test_rope_and_write_kv_fp8_head_scale_values() -> None:
    c = _fp8_head_case(300, 32, 2, 128, torch.bfloat16)
    live = c["slots"][c["slots"] >= 0]
    for i in (0, 1):  # k, v
        got, want = c["got"][i].flatten(0, 1)[live], c["want"][i].flatten(0, 1)[live]
        assert got.float().isfinite().all(), "a saturated value is not ±448"
        assert (got.float().abs() == 448).any(), "the case saturates nothing"
        same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
        assert same > 0.97, f"only {same:.3f} of fp8 codes match"
        scale = c["per_head"][i][None, :, None]
        torch.testing.assert_close(got.float() * scale, want.float() * scale, rtol=0.13, atol=1e-3)
