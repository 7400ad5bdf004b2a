"""Dequantizing a packed weight on the device equals ``unpack`` rounded to the dtype (up to the
sign of zero), and ``packed_matmul``'s DEQUANT path (a dense matmul over that copy) computes the
product."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.layout import PACKED_TYPES
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_dequant import dequantize_packed, dequantize_packed_rows
from shared.kernels.qmatmul.packed_gemm import SMALL_TILE
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from shared.quant import dequantize
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: t.name)
def test_dequantize_packed_is_unpack_rounded(qtype: T, dtype: torch.dtype) -> None:
    n, k = 40, 512  # a ragged row tile
    pw = pack(random_raw(qtype, n, k, seed=int(qtype)).to(DEVICE), qtype, (n, k))
    got = dequantize_packed(pw, dtype, block_n=32)
    # equal values (q * d - offset can give +0.0 where the reference has -0.0)
    assert got.dtype == dtype and torch.equal(got.float(), unpack(pw).to(dtype).float())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_1], ids=lambda t: t.name)
def test_dequant_path_computes_the_product(qtype: T) -> None:
    n, k, m = 48, 512, 70
    pw = pack(random_raw(qtype, n, k, seed=5).to(DEVICE), qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want = x.double() @ unpack(pw).double().T
    got = packed_matmul(x, pw, config={"DEQUANT": 1})
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    fused = packed_matmul(x, pw, config=SMALL_TILE)  # the fused GEMM's tiles
    torch.testing.assert_close(got, fused, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act", [0, 1, 2], ids=["none", "silu", "gelu"])
def test_dequant_path_in_bf16_with_and_without_the_gated_activation(act: int) -> None:
    n, k, m = 64, 512, 70
    pw = pack(random_raw(T.Q4_K, n, k, seed=act).to(DEVICE), T.Q4_K, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(act)).to(DEVICE)
    xb = x.to(torch.bfloat16)
    got = packed_matmul(xb, pw, config={"DEQUANT": 1}, act=act)
    y = xb.double() @ unpack(pw).to(torch.bfloat16).double().T
    if act:
        g, u = y[:, 0::2], y[:, 1::2]
        y = (F.silu(g) if act == 1 else F.gelu(g, approximate="tanh")) * u
    assert got.dtype == torch.bfloat16 and got.shape == y.shape
    torch.testing.assert_close(got.double(), y, rtol=2e-2, atol=2e-2 * y.abs().max().item())


def test_dequantize_packed_rejects_a_wrong_out() -> None:
    pw = pack(random_raw(T.Q8_0, 8, 256, seed=1).to(DEVICE), T.Q8_0, (8, 256))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_packed(pw, torch.float16, out=torch.empty(8, 128, device=DEVICE))


@pytest.mark.parametrize("rows32", [False, True], ids=["plain", "interleaved"])
@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: t.name)
def test_dequantize_packed_rows_is_the_blocks_dequantized(qtype: T, rows32: bool) -> None:
    """A token embedding's lookup: the gathered rows equal shared.quant.dequantize of their
    GGUF blocks, bit for bit, from plain or row-interleaved planes, for 1 or 37 ids."""
    n, k = 70, 512
    raw = random_raw(qtype, n, k, seed=int(qtype) + 1)
    pw = pack(raw.to(DEVICE), qtype, (n, k))
    if rows32:
        pw = interleave(pw)
    for ids in ([69], [3, 0, 69, 3, *range(5, 38)]):
        want = dequantize(raw[ids], qtype, (len(ids), k)).to(torch.bfloat16)
        got = dequantize_packed_rows(pw, torch.tensor(ids, device=DEVICE), torch.bfloat16)
        assert got.shape == want.shape and torch.equal(got.float().cpu(), want.float())
    with pytest.raises(ValueError, match="ids must be"):
        bad = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
        dequantize_packed_rows(pw, bad, torch.float32)
