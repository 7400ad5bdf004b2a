"""The factored packed GEMV (``FACTOR: 1``) computes ``x @ unpack(pw).T`` for every packed type,
with split-K, ragged row tiles and every activation dtype."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.layout import PACKED_TYPES
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("split", [1, 3])
def test_factored_gemv_computes_the_product(qtype: T, split: int) -> None:
    n, k = 37, 1024  # a ragged row tile; 4 or 8 chunks
    pw = pack(random_raw(qtype, n, k, seed=int(qtype) + split).to(DEVICE), qtype, (n, k))
    x = torch.randn(1, k, device=DEVICE)
    want = x.double() @ unpack(pw).double().T
    cfg = {"BLOCK_N": 16, "SPLIT_K": split, "num_warps": 2, "FACTOR": 1}
    got = packed_matmul(x, pw, torch.float32, config=cfg)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_factored_gemv_takes_16_bit_activations(dtype: torch.dtype) -> None:
    n, k = 32, 512
    pw = pack(random_raw(T.Q4_K, n, k, seed=9).to(DEVICE), T.Q4_K, (n, k))
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    want = x.double() @ unpack(pw).double().T
    got = packed_matmul(x, pw, config={"BLOCK_N": 32, "SPLIT_K": 1, "num_warps": 2, "FACTOR": 1})
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
