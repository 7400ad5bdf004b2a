"""The int8 tensor-core GEMM of decode batches (``I8: 1``, shared/kernels/qmatmul/packed_gemm8.py)
and its activation rounding (``int8_activations.prepare_rows_int8``):

- the rows are rounded as the GEMV rounds one row (same codes, steps and sums), or for the
  K-quants with one step a chunk and the integer sums of the sub-blocks' codes;
- exact where int8 loses nothing (activations that are int8 codes times a power of two per
  sub-block): ``x @ unpack(pw).T`` up to float32 summation order, for every int8 type, both
  plane layouts, split-K and the gated epilogue;
- within the rounding's error bound for random activations.

Under TRITON_INTERPRET=1 numpy's integer matmul stands in for the tensor cores."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.int8_activations import prepare_int8, prepare_rows_int8
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_gemm8 import CHUNK_STEP_TYPES, I8_TYPES
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from tests.test_kernel_packed_int8 import _layout, representable
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "I8": 1}


def _weight(qtype: T, n: int, k: int, seed: int):
    return pack(random_raw(qtype, n, k, seed=seed).to(DEVICE), qtype, (n, k))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rows_are_rounded_as_the_gemv_rounds_one(qtype: T) -> None:
    k = 512
    pw = _weight(qtype, 4, k, seed=1)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    xq, xd, xs = prepare_rows_int8(x, pw)
    w, g = _layout(qtype)
    for r in range(3):
        wq, wd, ws = prepare_int8(x[r : r + 1], pw)
        assert torch.equal(xd[r], wd)
        if DEVICE == "cpu":  # the same sums in the same order
            assert torch.equal(xs[r], ws)
        else:  # two launches' float sums, reduced in another order on a GPU
            torch.testing.assert_close(xs[r], ws, rtol=1e-5, atol=1e-6)
        # the GEMV's words xq[c, a, j] (byte t: element W*j + 4a + t of chunk c) in row order
        words = wq.view(torch.int8).reshape(k // (w * g), w // 4, g, 4).permute(0, 2, 1, 3)
        assert torch.equal(words.reshape(k), xq[r])


def test_k_quant_rows_take_one_step_a_chunk() -> None:
    k = 512
    pw = _weight(T.Q4_K, 4, k, seed=1)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    xq, xd, xs = prepare_rows_int8(x, pw, chunk_step=True)
    chunks = x.cpu().reshape(3, k // 256, 256)
    step = chunks.abs().amax(2) / 127
    torch.testing.assert_close(xd.cpu(), step)
    v = chunks / step[:, :, None]
    want = (v.sign() * (v.abs() + 0.5).floor()).to(torch.int8).reshape(3, k)
    assert torch.equal(xq.cpu(), want)
    assert xs.dtype == torch.int32
    assert torch.equal(xs.cpu(), want.reshape(3, k // 32, 32).int().sum(2))


@pytest.mark.parametrize("qtype", sorted(I8_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows32", [False, True], ids=["plain", "interleaved"])
def test_exact_activations_give_the_product(qtype: T, rows32: bool) -> None:
    n, k, m = 40, 512, 5  # a ragged row tile and batch
    pw = _weight(qtype, n, k, seed=int(qtype))
    w, g = _layout(qtype)
    step = w * g if qtype in CHUNK_STEP_TYPES else w  # elements that share an activation step
    x = torch.cat([representable(k, step, seed=s) for s in range(m)]).to(DEVICE)
    want = x.double() @ unpack(pw).double().T
    cfg = {**CFG, "SPLIT_K": 2 if rows32 else 1}
    got = packed_matmul(x, interleave(pw) if rows32 else pw, torch.float32, config=cfg)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_random_activations_stay_within_the_rounding_bound(qtype: T) -> None:
    n, k, m = 64, 512, 6
    pw = _weight(qtype, n, k, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    w = unpack(pw).double()
    want = x.double() @ w.T
    got = packed_matmul(x.to(torch.bfloat16), pw, torch.float32, config=CFG)
    # x rounded to bf16 first (the kernel reads the bf16 activations), then to int8
    xb = x.to(torch.bfloat16).double()
    words, g = _layout(qtype)
    size = words * g if qtype in CHUNK_STEP_TYPES else words
    blocks = xb.reshape(m, -1, size)  # the activations' blocks of one step
    step = (blocks.abs().amax(2, keepdim=True) / 127).expand_as(blocks).reshape(m, k)
    bound = (step / 2) @ w.abs().T + ((xb - x.double()).abs() @ w.abs().T)
    err = (got.double() - want).abs()
    assert bool((err <= bound * 1.001 + 1e-5).all()), float((err / bound).max())


@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu"])
def test_gated_epilogue(act: int) -> None:
    n, k = 64, 512
    pw = _weight(T.Q4_K, n, k, seed=act)
    x = torch.cat([representable(k, 256, seed=s) for s in range(3)]).to(DEVICE)
    got = packed_matmul(x, interleave(pw), torch.float32, {**CFG, "SPLIT_K": 1}, act=act)
    y = x.double() @ unpack(pw).double().T
    g, u = y[:, 0::2], y[:, 1::2]
    want = (F.silu(g) if act == 1 else F.gelu(g, approximate="tanh")) * u
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="Llama-3-8B shapes and 64-row wgmma tiles: GPU only")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [16, 64])
def test_llama_shapes_in_wgmma_tiles(qtype: T, m: int) -> None:
    n, k = 6144, 4096
    pw = interleave(_weight(qtype, n, k, seed=3))
    w, g = _layout(qtype)
    step = w * g if qtype in CHUNK_STEP_TYPES else w
    x = torch.cat([representable(k, step, seed=s) for s in range(m)]).to(DEVICE)
    want = x.double() @ unpack(pw).double().T
    cfg = {**CFG, "BLOCK_M": min(m, 64), "BLOCK_N": 64, "num_stages": 3}
    got = packed_matmul(x, pw, torch.float32, config=cfg)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
