"""The Triton K-quant GEMV agrees with dequantize-then-matmul (shared.quant.dequantize).

Random super-blocks: random bytes for quants and packed scales, explicit sane fp16 d/dmin. On a
CUDA device the kernel runs natively (`-m gpu` adds real Llama-3-8B shapes); on the CPU it runs
under the Triton interpreter, which the environment selects before triton is imported
(TRITON_INTERPRET=1); this module sets nothing itself.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "the Triton kernel needs a CUDA device or TRITON_INTERPRET=1 (CPU interpreter)",
        allow_module_level=True,
    )

from gguf import GGMLQuantizationType as T  # noqa: E402

from shared.kernels.qmatmul.kquants import KQUANT_TYPES, quant_gemv_kquant  # noqa: E402
from shared.quant import FP16_FIELDS, dequantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPE_SIZE = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
# byte offsets of the fp16 fields written explicitly (the rest stays random)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
TYPES = sorted(KQUANT_TYPES)


def random_raw(qtype: T, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[N, K / 256 * type_size] uint8: random quant/scale bytes, fp16 d, dmin in ±[1e-3, 1e-2]."""
    g = torch.Generator().manual_seed(seed)
    n_super, size = k // 256, TYPE_SIZE[qtype]
    raw = torch.randint(0, 256, (n, n_super, size), dtype=torch.uint8, generator=g)
    for offset in FP16_FIELDS[qtype]:
        mag = torch.empty(n, n_super).uniform_(1e-3, 1e-2, generator=g)
        sign = torch.randint(0, 2, (n, n_super), generator=g) * 2 - 1
        raw[:, :, offset : offset + 2] = (
            (mag * sign).half().view(torch.uint8).reshape(n, n_super, 2)
        )
    return raw.reshape(n, n_super * size).to(DEVICE)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def check(qtype: T, n: int, k: int, m: int, dtype: torch.dtype, tol: float, out_dtype=None) -> None:
    raw = random_raw(qtype, n, k, seed=n + k + m)
    g = torch.Generator(DEVICE).manual_seed(m)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    want = x.float() @ dequantize(raw, qtype, (n, k)).T
    got = quant_gemv_kquant(x, raw, qtype, out_dtype=out_dtype)
    assert got.shape == (m, n) and got.dtype == (out_dtype or dtype)
    err = rel_err(got, want)
    assert err < tol, f"{qtype.name} N={n} K={k} M={m} {dtype}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(64, 256), (48, 512)])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_matches_dequant_matmul(qtype: T, n: int, k: int, m: int, dtype: torch.dtype) -> None:
    check(qtype, n, k, m, dtype, TOL[dtype])


def test_out_dtype_and_split_k_agree() -> None:
    raw = random_raw(T.Q4_K, 40, 1280, seed=7)
    x = torch.randn(2, 1280, device=DEVICE)
    whole = quant_gemv_kquant(x, raw, T.Q4_K)
    split = quant_gemv_kquant(x, raw, T.Q4_K, out_dtype=torch.float32, split_k=3, block_n=16)
    want = x @ dequantize(raw, T.Q4_K, (40, 1280)).T
    assert rel_err(whole, want) < 1e-5 and rel_err(split, want) < 1e-5


def test_rejects_bad_inputs() -> None:
    raw = random_raw(T.Q6_K, 8, 256)
    x = torch.randn(1, 256, device=DEVICE)
    with pytest.raises(NotImplementedError, match="Q3_K"):
        quant_gemv_kquant(x, raw, T.Q3_K)
    with pytest.raises(ValueError, match="not a K-quant"):
        quant_gemv_kquant(x, raw, T.Q8_0)
    with pytest.raises(ValueError, match="bytes"):
        quant_gemv_kquant(x, raw, T.Q4_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        quant_gemv_kquant(torch.randn(1, 200, device=DEVICE), raw, T.Q6_K)
    with pytest.raises(ValueError, match="M=65"):
        quant_gemv_kquant(torch.randn(65, 256, device=DEVICE), raw, T.Q6_K)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", [(14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_real_shapes_gpu(qtype: T, n: int, k: int, m: int) -> None:
    if DEVICE != "cuda":
        pytest.skip("real shapes need a CUDA device")
    # fp32 out: rounding the output to bf16 alone costs ~1.7e-3, more than this bound allows
    check(qtype, n, k, m, torch.bfloat16, 1e-3, out_dtype=torch.float32)
