"""The legacy-block quantized GEMV (shared/kernels/qmatmul/legacy.py) against
``x.float() @ dequantize(raw).T``. On CUDA when present, else on the CPU under the Triton
interpreter (TRITON_INTERPRET=1 must be set before triton is imported). The `gpu` test runs
Llama-3-8B FFN shapes: `pytest -m gpu`."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "Triton kernels need a CUDA device or TRITON_INTERPRET=1 (CPU interpreter)",
        allow_module_level=True,
    )

from shared.kernels.qmatmul import LEGACY_TYPES, quant_gemv_legacy
from shared.quant import FP16_FIELDS, dequantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 x: only float32 summation order differs. bf16 x: the output is rounded to bf16 (the
# interpreter truncates, so up to 1 ulp = 2^-8 relative).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_raw(qtype: T, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, k / 32 * type_size]: random quant bytes, finite fp16 scales of mixed sign."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n * k // block_size
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scale = 10.0 ** rng.uniform(-4, 0, n_blocks) * rng.choice([-1.0, 1.0], n_blocks)
        raw[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1)).to(DEVICE)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def check(qtype: T, n: int, k: int, m: int, dtype: torch.dtype, split_k: int | None = None):
    raw = random_raw(qtype, n, k, seed=int(qtype) * 1000 + n + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(device=DEVICE, dtype=dtype)
    y = quant_gemv_legacy(x, raw, qtype, split_k=split_k)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = x.float() @ dequantize(raw, qtype, (n, k)).T
    err = rel_err(y, ref)
    assert err < TOL[dtype], f"{qtype.name} N={n} K={k} M={m} {dtype}: rel error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("shape", [(96, 256), (64, 512)], ids=["96x256", "64x512"])
@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda t: t.name)
def test_matches_dequantized_matmul(
    qtype: T, shape: tuple[int, int], m: int, dtype: torch.dtype
) -> None:
    check(qtype, *shape, m, dtype)


@pytest.mark.parametrize("m", [2, 40])
@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda t: t.name)
def test_split_k_and_ragged_tiles(qtype: T, m: int) -> None:
    # 9 blocks per row: K is not a multiple of the K chunk; N = 40 is not a multiple of BLOCK_N.
    check(qtype, 40, 288, m, torch.float32, split_k=3)


def test_strided_rows_and_out_dtype() -> None:
    n, k = 48, 256
    raw = random_raw(T.Q5_1, n, k, seed=3)
    wide = torch.zeros(n, raw.shape[1] + 6, dtype=torch.uint8, device=DEVICE)
    wide[:, 2 : 2 + raw.shape[1]] = raw  # row stride != row bytes, unaligned base
    x = torch.randn(5, k + 32, device=DEVICE)[:, :k]
    y = quant_gemv_legacy(x, wide[:, 2 : 2 + raw.shape[1]], T.Q5_1, out_dtype=torch.float16)
    assert y.dtype == torch.float16
    assert rel_err(y, x @ dequantize(raw, T.Q5_1, (n, k)).T) < 1e-3


def test_bad_inputs_raise() -> None:
    raw = random_raw(T.Q4_0, 8, 64, seed=0)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="Q4_K is not one of"):
        quant_gemv_legacy(x, raw, T.Q4_K)
    with pytest.raises(ValueError, match="needs rows of"):
        quant_gemv_legacy(torch.randn(2, 96, device=DEVICE), raw, T.Q4_0)
    with pytest.raises(ValueError, match="uint8"):
        quant_gemv_legacy(x, raw.float(), T.Q4_0)
    with pytest.raises(ValueError, match="contiguous"):
        quant_gemv_legacy(torch.randn(64, 2, device=DEVICE).T, raw, T.Q4_0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("shape", [(14336, 4096), (4096, 14336)], ids=["up", "down"])
@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda t: t.name)
def test_real_shapes_gpu(qtype: T, shape: tuple[int, int], m: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, k = shape
    raw = random_raw(qtype, n, k, seed=int(qtype))
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    ref = x.float() @ dequantize(raw, qtype, (n, k)).T
    # float32 output isolates the kernel's own error from the bf16 rounding of the result
    assert rel_err(quant_gemv_legacy(x, raw, qtype, out_dtype=torch.float32), ref) < 1e-3
    assert rel_err(quant_gemv_legacy(x, raw, qtype), ref) < 1e-2
