"""Packed quantized weights: repacking is lossless (bit-identical to gguf.quants when dequantized)
and the Triton GEMV/GEMM over the packed planes agree with ``x @ unpack(pw).T``.

On the CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by the
environment before triton is imported); `-m gpu` adds Llama-3-8B shapes natively.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from shared.kernels.qmatmul.layout import PACKED_TYPES
from shared.kernels.qmatmul.packed import pack, unpack
from shared.quant import FP16_FIELDS, block_geometry

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
TYPES = sorted(PACKED_TYPES)


def random_raw(qtype: T, n: int, k: int, seed: int, sane: bool = True) -> torch.Tensor:
    """[N, row_bytes] uint8 random blocks; `sane` writes fp16 scales in ±[1e-3, 1e-2]."""
    g = torch.Generator().manual_seed(seed)
    block, size = block_geometry(qtype)
    raw = torch.randint(0, 256, (n * k // block, size), dtype=torch.uint8, generator=g)
    if sane:
        for off in FP16_FIELDS[qtype]:
            mag = torch.empty(raw.shape[0]).uniform_(1e-3, 1e-2, generator=g)
            sign = torch.randint(0, 2, (raw.shape[0],), generator=g) * 2 - 1
            raw[:, off : off + 2] = (mag * sign).half().view(torch.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpack_is_bit_identical_to_gguf(qtype: T) -> None:
    # Random bytes everywhere: subnormal, inf and NaN scales included.
    n, k = 24, 1024
    raw = random_raw(qtype, n, k, seed=int(qtype), sane=False)
    want = quants.dequantize(raw.numpy(), qtype).reshape(n, k).astype(np.float32)
    got = unpack(pack(raw, qtype, (n, k))).numpy()
    nan = np.isnan(want)  # NaN payloads may differ between numpy and torch; positions may not
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_pack_keeps_the_size(qtype: T) -> None:
    n, k = 8, 512
    raw = random_raw(qtype, n, k, seed=1)
    pw = pack(raw, qtype, (n, k))
    assert raw.numel() <= pw.nbytes <= 1.04 * raw.numel()
    assert pw.q.dtype == torch.int32 and pw.q.is_contiguous()


def test_pack_rejects_what_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError, match="BF16 has no packed layout"):
        pack(torch.zeros(4, 512, dtype=torch.uint8), T.BF16, (4, 256))
    with pytest.raises(ValueError, match="K=32 is not a multiple of 128"):
        pack(torch.zeros(4, 34, dtype=torch.uint8), T.Q8_0, (4, 32))
    with pytest.raises(ValueError, match="blocks do not make"):
        pack(torch.zeros(4, 144, dtype=torch.uint8), T.Q4_K, (2, 256))


def _check(qtype: T, n: int, k: int, m: int, dtype: torch.dtype, config=None) -> None:
    from shared.kernels.qmatmul.packed_matmul import default_config, packed_matmul

    pw = pack(random_raw(qtype, n, k, seed=n + m).to(DEVICE), qtype, (n, k))
    w = unpack(pw)
    g = torch.Generator(DEVICE).manual_seed(m)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    # M = 1 multiplies float32 weights; the GEMM rounds them to x's dtype like the dense path
    # (the fp16-formed GEMM, F16, forms them with fp16 roundings: its own tolerance)
    f16 = (config or default_config(m, n, k, x.device, qtype, dtype=dtype)).get("F16")
    w_ref = w if m == 1 or f16 else w.to(dtype).float()
    want = x.double() @ w_ref.double().T
    got = packed_matmul(x, pw, out_dtype=torch.float32, config=config)
    assert got.shape == (m, n)
    err = ((got.double() - want).norm() / want.norm()).item()
    # tensor cores add products in an order (and alignment) of their own: looser on the GPU
    tol = 2e-5 if m > 1 and DEVICE == "cuda" else 2e-6
    tol = 2e-3 if f16 else tol  # the tuner's F16_TOL
    assert err < tol, f"{qtype.name} M={m} {dtype}: relative error {err:.2e}"
    if dtype != torch.float32:
        assert packed_matmul(x, pw, config=config).dtype == dtype


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_matmul_small(qtype: T, m: int, dtype: torch.dtype) -> None:
    _check(qtype, 40, 512, m, dtype)


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_packed_gemv_split_k_and_ragged_tiles(qtype: T) -> None:
    _check(qtype, 37, 1024, 1, torch.bfloat16, config={"BLOCK_N": 16, "SPLIT_K": 3})


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_dense_path_keeps_a_float32_result(qtype: T) -> None:
    """DEQUANT with 16-bit activations and a float32 result (the tuner's reference above 64
    rows): the product is not rounded to the activations' dtype first (it was, 1.7e-3 off:
    every 512-row case of the H200's llama3-shape test failed its 2e-5)."""
    _check(qtype, 64, 1024, 512, torch.bfloat16, config={"DEQUANT": 1})


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_N": 16, "SPLIT_K": 4},
        {"BLOCK_N": 16, "SPLIT_K": 4, "FACTOR": 1},
        {"BLOCK_N": 16, "SPLIT_K": 4, "INT8": 1},
    ],
    ids=["gemv", "factored", "int8"],
)
def test_split_gemv_tickets_return_to_zero(cfg: dict) -> None:
    """The last program of each row tile adds the split partials and resets its counter, so a
    weight's next launches start from zero and give the same result bit for bit."""
    from shared.kernels.qmatmul.packed_matmul import packed_matmul

    n, k = 40, 1024  # 3 row tiles (the last ragged) x 4 splits
    pw = pack(random_raw(T.Q4_K, n, k, seed=5).to(DEVICE), T.Q4_K, (n, k))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    first = packed_matmul(x, pw, config=cfg)
    assert not pw.tickets.any()
    for _ in range(2):
        assert torch.equal(packed_matmul(x, pw, config=cfg), first)
    assert not pw.tickets.any()
    want = x.double() @ unpack(pw).to(DEVICE).double().T
    tol = 0.05 if cfg.get("INT8") else 1e-3  # int8 activations: within their rounding
    torch.testing.assert_close(first.double(), want, rtol=tol, atol=tol * want.abs().max())


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_gemm_wide_chunks(qtype: T, dtype: torch.dtype) -> None:
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "WIDE": 1}
    _check(qtype, 40, 512, 5, dtype, config=cfg)


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_packed_gemm_split_k_and_ragged_tiles(qtype: T) -> None:
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "SPLIT_K": 3}
    _check(qtype, 37, 1024, 5, torch.bfloat16, config=cfg)
    _check(qtype, 40, 1024, 20, torch.float32, config={**cfg, "SPLIT_K": 4})
    _check(qtype, 37, 1024, 1, torch.bfloat16, config={"BLOCK_N": 16, "SPLIT_K": 3, "UNROLL": 1})
    _check(qtype, 37, 512, 5, torch.bfloat16, config={"BLOCK_M": 16, "BLOCK_N": 32})


def test_packed_matmul_rejects_a_wrong_shape() -> None:
    from shared.kernels.qmatmul.packed_matmul import packed_matmul

    pw = pack(random_raw(T.Q8_0, 4, 128, seed=0), T.Q8_0, (4, 128))
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        packed_matmul(torch.zeros(2, 64), pw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
# a square one and a long K (split-K, 56 chunks): every case writes its blocks on the CPU
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 14336)])
@pytest.mark.parametrize("m", [1, 7, 64, 512])
def test_packed_matmul_llama3_shapes(qtype: T, shape: tuple[int, int], m: int) -> None:
    _check(qtype, *shape, m, torch.bfloat16)
    if m == 512:  # the dense path (DEQUANT), a tuner candidate there, too
        _check(qtype, *shape, m, torch.bfloat16, config={"DEQUANT": 1})
