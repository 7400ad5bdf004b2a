"""The fp16 decode-batch GEMM (packed_gemm16) against ``x @ unpack(pw).T``: weights and
activations rounded to fp16 once each, so within fp16's error of the exact product, with split-K,
ragged tiles and the gated epilogue. Under the Triton interpreter on the CPU (TRITON_INTERPRET=1),
natively on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_gemm16 import chunk_order, prepare_x16
from shared.ops.activation import gelu_mul, silu_mul
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "F16": 1}


def _case(n: int, k: int, m: int, seed: int, dtype=torch.bfloat16, qtype: T = T.Q4_K):
    pw = pack(random_raw(qtype, n, k, seed=seed).to(DEVICE), qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    want = x.double() @ unpack(pw).to(DEVICE).double().T
    return pw, x, want


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp16 weights and activations: each product within ~2^-10 of itself, so a sum of K of
    # them within ~2^-10 of its size (a scale off by 1 % is not)
    err = (got.double() - want).abs().max().item()
    assert err <= 0.002 * want.abs().max().item(), err


@pytest.mark.parametrize("words", [32, 16])
def test_chunk_order_is_a_permutation_within_chunks(words: int) -> None:
    order = chunk_order(512, words, torch.device("cpu"))
    assert sorted(order.tolist()) == list(range(512))
    assert order[: 8 * words].max() < 8 * words
    # column 8 i + 2 j + h holds element words * (j + 4 h) + i
    assert order[8 * 3 + 2 * 1 + 1].item() == words * (1 + 4) + 3


@pytest.mark.parametrize("words", [32, 16])
def test_activations_in_tile_order(words: int) -> None:
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(words)) * 10
    x[0, :4] = torch.tensor([1e6, -1e6, 70000.0, 1e-9])  # past fp16's range, and tiny
    x = x.to(DEVICE, torch.bfloat16)
    want = x.float().clamp(-65504, 65504).half()[:, chunk_order(512, words, x.device)]
    assert torch.equal(prepare_x16(x, words), want)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("swap", [0, 1], ids=["x-first", "w-first"])
def test_product(qtype: T, m: int, dtype: torch.dtype, swap: int) -> None:
    from shared.kernels.qmatmul.packed_matmul import packed_matmul

    pw, x, want = _case(40, 512, m, seed=m, dtype=dtype, qtype=qtype)
    cfg = {**CFG, "SPLIT_K": 1, "SWAP": swap}
    assert packed_matmul(x, pw, config=cfg).dtype == dtype
    got = packed_matmul(x, pw, torch.float32, config=cfg)  # no output rounding
    assert got.shape == (m, 40)
    _close(got, want)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("swap", [0, 1], ids=["x-first", "w-first"])
def test_split_k(qtype: T, swap: int) -> None:
    """Three splits of three chunks (Q4_K) or six (Q6_K): every split's last chunk has no next
    chunk's factors to load ahead."""
    from shared.kernels.qmatmul.packed_matmul import packed_matmul

    pw, x, want = _case(40, 768, 3, seed=7, qtype=qtype)
    cfg = {**CFG, "SPLIT_K": 3, "SWAP": swap}
    _close(packed_matmul(x, pw, torch.float32, config=cfg), want)


@pytest.mark.parametrize(("act", "fn"), [(1, silu_mul), (2, gelu_mul)], ids=["silu", "gelu"])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("swap", [0, 1], ids=["x-first", "w-first"])
def test_gated_epilogue(act: int, fn, split: int, swap: int) -> None:
    from shared.kernels.qmatmul.packed_matmul import packed_matmul

    pw, x, want = _case(64, 512, 4, seed=act + 10 * split)
    cfg = {**CFG, "SPLIT_K": split, "SWAP": swap}
    got = packed_matmul(x, pw, torch.float32, config=cfg, act=act)
    ref = fn(want[:, 0::2], want[:, 1::2])
    assert got.shape == (4, 32)
    _close(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(4096, 4096), (28672, 4096), (4096, 14336)], ids=str)
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("swap", [0, 1], ids=["x-first", "w-first"])
def test_llama3_shapes(qtype: T, shape: tuple[int, int], block_n: int, swap: int) -> None:
    from shared.kernels.qmatmul.packed_matmul import packed_matmul

    n, k = shape
    pw, x, _ = _case(n, k, 64, seed=n + block_n, qtype=qtype)
    want = x.float() @ unpack(pw).to(DEVICE).T
    cfg = {"BLOCK_M": 64, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 3, "F16": 1}
    cfg["SWAP"] = swap
    _close(packed_matmul(x, pw, torch.float32, config=cfg), want.double())
