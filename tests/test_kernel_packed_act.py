"""The gated activation in the packed matmuls' epilogue (``packed_matmul(..., act=)``): rows are
gate/up pairs and the result is act(gate) * up, for every kernel path (GEMV, factored GEMV,
GEMM, WIDE, split-K partials, the dense copy), against the activation of the reference product."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)

CONFIGS = {
    "gemv": (1, {"BLOCK_N": 16, "SPLIT_K": 1, "num_warps": 2}),
    "gemv-split": (1, {"BLOCK_N": 16, "SPLIT_K": 3, "num_warps": 2}),
    "gemv-factored": (1, {"BLOCK_N": 32, "SPLIT_K": 1, "num_warps": 1, "FACTOR": 1}),
    "gemm": (5, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "SPLIT_K": 1}),
    "gemm-split": (5, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "SPLIT_K": 3}),
    "gemm-wide": (20, {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "SPLIT_K": 1, "WIDE": 1}),
    "dense-copy": (70, {"DEQUANT": 1}),
}


def reference(x: torch.Tensor, w: torch.Tensor, act: int) -> torch.Tensor:
    y = x.double() @ w.double().T
    g, u = y[:, 0::2], y[:, 1::2]
    return (F.silu(g) if act == 1 else F.gelu(g, approximate="tanh")) * u


@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu"])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_gated_epilogue(qtype: T, act: int, path: str) -> None:
    m, cfg = CONFIGS[path]
    n, k = 38, 1024  # 19 gate/up pairs: a ragged last tile
    pw = pack(random_raw(qtype, n, k, seed=n + act).to(DEVICE), qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    got = packed_matmul(x, pw, torch.float32, cfg, act=act)
    assert got.shape == (m, n // 2)
    want = reference(x, unpack(pw), act)
    # float32 sums in another order: errors scale with the largest product, not each value
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_act_needs_pairs() -> None:
    pw = pack(random_raw(T.Q8_0, 7, 256, seed=1).to(DEVICE), T.Q8_0, (7, 256))
    with pytest.raises(ValueError, match="gate/up pairs"):
        packed_matmul(torch.zeros(1, 256, device=DEVICE), pw, act=1)
    with pytest.raises(ValueError, match="act 3"):
        packed_matmul(torch.zeros(1, 256, device=DEVICE), pw, act=3)
