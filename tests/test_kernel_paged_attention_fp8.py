"""The Triton paged attention over an FP8 (e4m3) cache agrees with the torch reference: scales
per token and KV head (read from the cache's bytes or natively), and one fixed scale per KV head;
the byte decoder and the reference quantizer. Helpers and the interpreter / GPU selection:
tests/test_kernel_paged_attention.py."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from shared.ops.paged_attention_fp8 import FP8, quantize_kv_fp8
from tests.test_kernel_paged_attention import (
    BF16,
    DEVICE,
    F16,
    F32,
    NATIVE,
    TOL,
    Batch,
    assert_close,
    fp8_reference,
    make_batch,
    pa,
    run_kernel,
    scenario,
    small_tiles,  # noqa: F401 - the fixture (usefixtures)
    to_fp8,
)


@pytest.mark.parametrize("native", [True, False], ids=["native", "from_bytes"])
@pytest.mark.parametrize(
    "name,q_dtype,scale_dtype,group,head_dim,window,splits",
    [
        ("mixed", F16, F32, 4, 64, 0, 1),
        ("chunk", BF16, F16, 3, 64, 8, 2),
        ("decode", F16, F16, 1, 256, 0, 3),
        ("mixed", F32, F32, 1, 64, 10, 1),
    ],
    ids=lambda v: str(v),
)
@pytest.mark.usefixtures("small_tiles")
def test_fp8_matches_reference(
    monkeypatch, native, name, q_dtype, scale_dtype, group, head_dim, window, splits
) -> None:
    if native and NATIVE and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8e4nv loads need sm_89+")
    monkeypatch.setattr(pa, "_native_fp8", lambda device: native)
    batch = make_batch(*scenario(name), n_heads=group * 2, n_kv_heads=2, head_dim=head_dim)
    batch, ks, vs = to_fp8(batch, q_dtype, scale_dtype)
    assert batch.k_cache.dtype == FP8 and ks.dtype == scale_dtype
    scale = head_dim**-0.5
    out = run_kernel(batch, scale, window, k_scale=ks, v_scale=vs, num_splits=splits)
    assert_close(out, fp8_reference(batch, ks, vs, scale, window), TOL[q_dtype])


def to_fp8_head_scales(
    batch: Batch, q_dtype: torch.dtype
) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """The batch with its cache quantized to FP8 under one fixed scale per KV head, seen as
    [blocks, block_size, kv_heads] with block and slot strides 0 (KVPool(scales="head")); poisoned
    slots hold fp8 NaN codes."""
    caches = []
    for cache in (batch.k_cache, batch.v_cache):
        x = cache.float()
        poisoned = x.isnan().any(-1)
        x = torch.nan_to_num(x) * torch.linspace(0.5, 6, x.shape[2], device=DEVICE)[:, None]
        per_head = x.abs().amax(dim=(0, 1, 3)) / 448
        values = (x / per_head[:, None]).clamp(-448, 448).to(FP8)
        values.view(torch.uint8)[poisoned] = 0x7F  # e4m3fn NaN
        caches.append((values, per_head.expand(cache.shape[:3])))
    (k8, ks), (v8, vs) = caches
    assert ks.stride()[:2] == (0, 0)
    fp8 = Batch(batch.q.to(q_dtype), k8, v8, batch.block_tables, batch.query_start_loc,
                batch.seq_lens)  # fmt: skip
    return fp8, ks, vs


@pytest.mark.parametrize("native", [True, False], ids=["native", "from_bytes"])
@pytest.mark.parametrize(
    "name,q_dtype,splits", [("mixed", F16, 1), ("decode", BF16, 3)], ids=lambda v: str(v)
)
@pytest.mark.usefixtures("small_tiles")
def test_fp8_head_scales_match_reference(monkeypatch, native, name, q_dtype, splits):
    """One scale per KV head (zero block and slot strides) reads like per-token scales."""
    if native and NATIVE and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8e4nv loads need sm_89+")
    monkeypatch.setattr(pa, "_native_fp8", lambda device: native)
    batch = make_batch(*scenario(name), n_heads=4, n_kv_heads=2, head_dim=64)
    batch, ks, vs = to_fp8_head_scales(batch, q_dtype)
    scale = 64**-0.5
    out = run_kernel(batch, scale, k_scale=ks, v_scale=vs, num_splits=splits)
    assert_close(out, fp8_reference(batch, ks, vs, scale), TOL[q_dtype])


@pytest.mark.parametrize("name", ["decode", "chunk"])
@pytest.mark.usefixtures("small_tiles")
def test_fp8_small_values_keep_their_precision(name) -> None:
    """V values around 1e-4 (scales near 1e-7): the probabilities times V's per-token scales stay
    in fp16's normal range (V_LIFT), so fp16 queries lose no more than at ordinary magnitudes
    against the float32 reference (measured 3e-4 at every magnitude; 1e-2 without the lift)."""
    torch.manual_seed(0)
    batch = make_batch(*scenario(name), n_heads=4, n_kv_heads=2, head_dim=64)
    batch.v_cache = batch.v_cache * 1e-4
    batch, ks, vs = to_fp8(batch, F16)
    out = run_kernel(batch, 64**-0.5, k_scale=ks, v_scale=vs)
    exact = Batch(batch.q.float(), batch.k_cache, batch.v_cache, batch.block_tables,
                  batch.query_start_loc, batch.seq_lens)  # fmt: skip
    assert_close(out.float(), fp8_reference(exact, ks, vs, 64**-0.5), 1e-3)


@triton.jit
def _decode_bytes_kernel(x_ptr, y_ptr):  # [256] uint8 -> [256] float32
    i = tl.arange(0, 256)
    tl.store(y_ptr + i, pa._fp8_e4m3_from_bytes(tl.load(x_ptr + i)))


def test_fp8_byte_decoder_is_exact() -> None:
    x = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    y = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _decode_bytes_kernel[(1,)](x, y)
    want = x.view(FP8).float()
    finite = torch.isfinite(want)
    assert finite.sum() == 254  # 0x7f and 0xff are NaN
    assert torch.equal(y[finite], want[finite])


def test_quantize_kv_fp8() -> None:
    x = torch.randn(40, 3, 64) * torch.logspace(-3, 3, 40)[:, None, None]
    x[5, 1] = 0
    values, scales = quantize_kv_fp8(x)
    assert values.dtype == FP8 and scales.shape == (40, 3) and scales.dtype == F32
    assert scales[5, 1] == 1 and (values[5, 1].float() == 0).all()
    assert torch.allclose(values.float().abs().amax(-1)[scales != 1], torch.tensor(448.0))
    back = values.float() * scales[..., None]
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) / 16).all()  # e4m3: 3 mantissa bits
    _, half = quantize_kv_fp8(x, torch.float16)
    assert half.dtype == F16
