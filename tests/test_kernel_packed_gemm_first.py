"""The weights-first decode-batch GEMM (packed_gemm_first) against ``x @ unpack(pw).T`` with the
weights rounded to the activations' dtype, as the reference rounds them: only the summation
order differs. Every packed type, plain and row-interleaved planes, split-K, ragged tiles and
the gated epilogue. Under the Triton interpreter on the CPU (TRITON_INTERPRET=1), natively on
a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.layout import PACKED_TYPES
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import FIRST_ROWS, default_config, packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from shared.ops.activation import gelu_mul, silu_mul
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
CFG = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "FIRST": 1}


def _case(qtype: T, n: int, k: int, m: int, seed: int, dtype=torch.bfloat16, rows32=False):
    pw = pack(random_raw(qtype, n, k, seed=seed).to(DEVICE), qtype, (n, k))
    w = unpack(pw).to(dtype).double()  # the reference's weights, rounded as the kernel's
    if rows32:
        pw = interleave(pw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    xd = x.double()
    return pw, x, xd @ w.T, xd.abs() @ w.abs().T


def _close(got: torch.Tensor, want: torch.Tensor, size: torch.Tensor) -> None:
    # exact products summed in float32: within a few float32 roundings of the sum of |products|
    # (a field or scale taken wrongly is off by whole products)
    err = ((got.double() - want).abs() / size.clamp_min(1e-30)).max().item()
    assert err <= 1e-5, err


@needs_kernels
@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES), ids=lambda t: T(t).name)
@pytest.mark.parametrize("rows32", [False, True], ids=["plain", "rows32"])
def test_product_every_type(qtype: int, rows32: bool) -> None:
    qtype = T(qtype)
    pw, x, want, size = _case(qtype, 80, 512, 5, seed=int(qtype), rows32=rows32)
    got = packed_matmul(x, pw, torch.float32, config={**CFG, "SPLIT_K": 1})
    assert got.shape == (5, 80)
    _close(got, want, size)
    assert packed_matmul(x, pw, config={**CFG, "SPLIT_K": 1}).dtype == torch.bfloat16


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_fp16_and_a_second_row_tile(qtype: T, split: int) -> None:
    """fp16 activations, 20 rows (two tiles of 16, the second ragged), K split in 2 or 3."""
    pw, x, want, size = _case(qtype, 64, 768, 20, seed=split, dtype=torch.float16)
    cfg = {**CFG, "SPLIT_K": split}
    _close(packed_matmul(x, pw, torch.float32, config=cfg), want, size)


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K, T.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("fj", [2, 4])
def test_fields_joined_along_k(qtype: T, fj: int) -> None:
    """FJ adjacent fields as one dot of K = FJ * W: the same products."""
    pw, x, want, size = _case(qtype, 80, 512, 5, seed=fj, rows32=True)
    cfg = {**CFG, "SPLIT_K": 2, "FJ": fj}
    _close(packed_matmul(x, pw, torch.float32, config=cfg), want, size)


@needs_kernels
@pytest.mark.parametrize(("act", "fn"), [(1, silu_mul), (2, gelu_mul)], ids=["silu", "gelu"])
@pytest.mark.parametrize("split", [1, 2])
def test_gated_epilogue(act: int, fn, split: int) -> None:
    pw, x, want, _ = _case(T.Q4_K, 128, 512, 4, seed=act + 10 * split, rows32=True)
    got = packed_matmul(x, pw, torch.float32, config={**CFG, "SPLIT_K": split}, act=act)
    ref = fn(want[:, 0::2], want[:, 1::2])
    assert got.shape == (4, 64)
    err = (got.double() - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err


def test_default_config_takes_it_where_it_won() -> None:
    """Q4_K and Q8_0 at 2-64 rows with 16-bit activations and at least FIRST_ROWS weight rows
    (BENCHMARKS.md (aa)); not Q6_K, float32 activations, batch 1, prefill or small N."""
    cpu = torch.device("cpu")
    for m in (2, 16, 17, 64):
        for qtype in (T.Q4_K, T.Q8_0):
            assert default_config(m, FIRST_ROWS, 4096, cpu, qtype).get("FIRST") == 1
            assert "FIRST" not in default_config(m, 1024, 4096, cpu, qtype)
            assert "FIRST" not in default_config(m, 4096, 4096, cpu, qtype, dtype=torch.float32)
        assert "FIRST" not in default_config(m, 4096, 4096, cpu, T.Q6_K)
    for m in (1, 65, 512):
        assert "FIRST" not in default_config(m, 4096, 4096, cpu, T.Q4_K)
    big = default_config(64, 28672, 4096, torch.device("cpu"), T.Q4_K)
    assert (big["BLOCK_N"], big["num_warps"], big["SPLIT_K"], big.get("FJ", 1)) == (128, 8, 1, 1)
    small = default_config(16, 4096, 4096, cpu, T.Q8_0)
    assert (small["BLOCK_M"], small["BLOCK_N"], small["SPLIT_K"], small["FJ"]) == (16, 64, 4, 4)
    assert default_config(64, 6144, 4096, cpu, T.Q4_K)["FJ"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(4096, 4096), (28672, 4096), (4096, 14336)], ids=str)
@pytest.mark.parametrize("m", [16, 64])
@pytest.mark.parametrize("fj", [1, 2])
def test_llama3_shapes_default_tiles(qtype: T, shape: tuple[int, int], m: int, fj: int) -> None:
    n, k = shape
    pw, x, want, size = _case(qtype, n, k, m, seed=n + m, rows32=True)
    cfg = {**default_config(m, n, k, x.device, T.Q4_K), "FIRST": 1, "FJ": fj}  # any type
    _close(packed_matmul(x, pw, torch.float32, config=cfg), want, size)
