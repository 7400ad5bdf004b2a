"""Dense copies of packed weights (shared/model/dense_copies.py): batches above the row limit
multiply by the copy, smaller ones by the packed planes, both give the product; `auto` makes no
copy on the CPU or where memory is short; `off` none; a bad mode is refused."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed import unpack
from shared.kernels.qmatmul.packed_matmul import int8_rows, packed_matmul
from shared.model.dense_copies import add_dense_copies
from shared.model.linear import GatedLinear, QuantLinear
from tests.oracle import compare, skiff_logits
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
K = 512


def _layer(qtype: T, n: int, seed: int) -> QuantLinear:
    raw = random_raw(qtype, n, K, seed=seed).to(DEVICE)
    return QuantLinear(raw, qtype, (n, K), torch.float32, use_kernels=True)


def _calls(monkeypatch) -> list[bool]:
    """Records, per packed_matmul call, whether it was handed a dense copy."""
    seen: list[bool] = []
    real = packed_matmul

    def spy(*args, **kw):
        seen.append(kw.get("dense") is not None)
        return real(*args, **kw)

    monkeypatch.setattr("shared.model.linear.packed_matmul", spy)
    return seen


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_big_batches_use_the_copy_small_ones_the_planes(qtype: T, monkeypatch) -> None:
    layer = _layer(qtype, 40, seed=int(qtype))
    model = torch.nn.Sequential(layer)
    size = add_dense_copies(model, "on", rows=4)
    assert size == 40 * K * 4 and layer.dense_rows == 4
    assert torch.equal(layer.dense_copy, unpack(layer.packed))  # float32: the exact values
    seen = _calls(monkeypatch)
    for m in (1, 4, 5, 9):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        want = x.double() @ unpack(layer.packed).double().T
        got = layer(x).double()
        # CUDA: 1 .. BATCH_ROWS rows of interleaved planes run the int8 rows GEMVs, within
        # their rounding of the activations
        if int8_rows(layer.packed, m):
            assert float((got - want).norm() / want.norm()) < 2e-2
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert seen == [False, False, True, True]


@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu"])
def test_gated_layers_use_the_copy_with_the_activation(act: int, monkeypatch) -> None:
    f = 24
    fused = _layer(T.Q4_K, 2 * f, seed=act)  # rows: gate/up pairs
    layer = GatedLinear(fused, act)
    add_dense_copies(torch.nn.Sequential(layer), "on", rows=2)
    seen = _calls(monkeypatch)
    # seeded: float32 products of these random blocks miss the 1e-4 tolerance for about 2 % of
    # inputs, and the global generator's state depends on the tests that ran before
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(act)).to(DEVICE)
    y = x.double() @ unpack(fused.packed).double().T
    g, u = y[:, 0::2], y[:, 1::2]
    want = (F.silu(g) if act == 1 else F.gelu(g, approximate="tanh")) * u
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-4, atol=1e-4)
    assert seen == [True]


def test_auto_and_off_make_no_copy_here(monkeypatch) -> None:
    layer = _layer(T.Q4_K, 16, seed=1)
    model = torch.nn.Sequential(layer)
    assert add_dense_copies(model, "off") == 0 and layer.dense_copy is None
    if DEVICE == "cpu":
        assert add_dense_copies(model, "auto") == 0 and layer.dense_copy is None
    else:  # a device whose free memory is short of four times the copies
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (16 * K * 4 * 3, 1))
        assert add_dense_copies(model, "auto") == 0 and layer.dense_copy is None
    with pytest.raises(ValueError, match="not one of"):
        add_dense_copies(model, "always")


def test_packed_matmul_checks_the_copy() -> None:
    layer = _layer(T.Q8_0, 8, seed=2)
    x = torch.randn(3, K, device=DEVICE)
    with pytest.raises(ValueError, match="dense must be"):
        packed_matmul(
            x, layer.packed, config={"DEQUANT": 1}, dense=torch.zeros(8, K // 2, device=DEVICE)
        )


@pytest.mark.gpu
def test_a_models_logits_with_and_without_dense_copies(synthetic_dir: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("packed layers need CUDA at model sizes")
    path = next((p for p in sorted(synthetic_dir.glob("*Q4_K_M.gguf"))), None)
    if path is None:
        pytest.skip("no synthetic Q4_K_M model in SKIFF_MODELS_DIR/synthetic")
    ids = [1] + np.random.default_rng(0).integers(3, 512, 99).tolist()
    # 20-token chunks: the packed GEMM without copies, the dense copies with them
    off = skiff_logits(path, ids, "cuda", chunk=20, dense_copies="off")
    on = skiff_logits(path, ids, "cuda", chunk=20, dense_copies="on")
    got = compare(on, off)
    assert got.top1 >= 0.99 and got.mean_abs_diff < 0.01, got
