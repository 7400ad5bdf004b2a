"""The int8-activation GEMV (``INT8: 1``, shared/kernels/qmatmul/packed_int8.py): its byte
operations against numpy, the activation quantizer against torch, and the product:

- exact where int8 loses nothing: activations that are int8 codes times a power of two per
  sub-block make the rounding exact, so the result must be ``x @ unpack(pw).T`` up to float32
  summation order (any wrong code, byte, scale or offset shows);
- within the rounding's error bound for random activations.

Under TRITON_INTERPRET=1 the integer emulation runs; on a GPU the PTX (dp4a, prmt)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from shared.kernels.device import interpreted
from shared.kernels.qmatmul.int8_activations import prepare_int8
from shared.kernels.qmatmul.int8_ops import dot4, dp4a, even_odd, transpose4
from shared.kernels.qmatmul.layout import INT8_TYPES, WORDS
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
TYPES = sorted(INT8_TYPES)
# the interpreter runs one chunk loop whatever PREFETCH says: the CPU tier runs it once
# (tests/tiers.py)
CPU_TIER = {"prefetch": {0}}


@triton.jit
def _ops_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr, INTERPRETED: tl.constexpr):
    i = tl.arange(0, N)
    a, b, c = tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i)
    tl.store(out_ptr + i, dp4a(a, b, c, False, INTERPRETED))
    tl.store(out_ptr + N + i, dp4a(a, b, c, True, INTERPRETED))
    t0, t1, t2, t3 = transpose4(a, b, c, a ^ b, INTERPRETED)
    tl.store(out_ptr + 2 * N + i, t0)
    tl.store(out_ptr + 3 * N + i, t1)
    tl.store(out_ptr + 4 * N + i, t2)
    tl.store(out_ptr + 5 * N + i, t3)
    e, o = even_odd(a, b, INTERPRETED)
    tl.store(out_ptr + 6 * N + i, e)
    tl.store(out_ptr + 7 * N + i, o)
    tl.store(out_ptr + 8 * N + i, dot4(a, b, False, INTERPRETED))
    tl.store(out_ptr + 9 * N + i, dot4(a, b, True, INTERPRETED))


def test_byte_operations_match_numpy() -> None:
    n = 256
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32) for _ in range(3))
    c = (c >> 8).astype(np.int32)  # room for the sums
    out = torch.empty(10 * n, dtype=torch.int32, device=DEVICE)
    args = [torch.from_numpy(v).to(DEVICE) for v in (a, b, c)]
    _ops_kernel[(1,)](*args, out, N=n, INTERPRETED=interpreted(_ops_kernel))
    got = out.cpu().numpy().reshape(10, n)

    def by(w):  # bytes, unsigned [n, 4]
        return w.view(np.uint8).reshape(n, 4).astype(np.int64)

    sb = by(b)
    sb = np.where(sb > 127, sb - 256, sb)
    ua = by(a)
    sa = np.where(ua > 127, ua - 256, ua)
    np.testing.assert_array_equal(got[0], c + (ua * sb).sum(1))
    np.testing.assert_array_equal(got[1], c + (sa * sb).sum(1))
    np.testing.assert_array_equal(got[8], (ua * sb).sum(1))  # dot4: dp4a into zero
    np.testing.assert_array_equal(got[9], (sa * sb).sum(1))
    words = np.stack([by(a), by(b), by(c), by(a ^ b)], axis=1)  # [n, word t, byte]
    for k in range(4):
        want = words[:, :, k].astype(np.uint8).copy().view(np.int32).reshape(n)
        np.testing.assert_array_equal(got[2 + k], want)
    pair = np.stack([by(a), by(b)], axis=1).reshape(n, 8).astype(np.uint8)
    np.testing.assert_array_equal(got[6], pair[:, 0::2].copy().view(np.int32)[:, 0])
    np.testing.assert_array_equal(got[7], pair[:, 1::2].copy().view(np.int32)[:, 0])


def _layout(qtype: T) -> tuple[int, int]:
    w = WORDS[qtype]
    return w, (128 if qtype in (T.Q6_K, T.Q8_0) else 256) // w  # (W, G)


def test_activation_quantizer() -> None:
    k = 512
    pw = pack(random_raw(T.Q4_K, 4, k, seed=1).to(DEVICE), T.Q4_K, (4, k))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    xq, xd, xs = (t.cpu() for t in prepare_int8(x, pw))
    w, g = _layout(T.Q4_K)
    blocks = x.cpu().reshape(-1, w)  # sub-blocks of W elements in order (chunk, j)
    amax = blocks.abs().amax(1)
    torch.testing.assert_close(xd, amax / 127)
    torch.testing.assert_close(xs, blocks.sum(1))
    v = blocks * (127 / amax)[:, None]
    want = (v.sign() * (v.abs() + 0.5).floor()).to(torch.int8)  # half away from zero
    # xq[c, a, j]: byte t = element W*j + 4a + t of chunk c
    got = xq.view(torch.int8).reshape(k // (w * g), w // 4, g, 4).permute(0, 2, 1, 3)
    assert torch.equal(got.reshape(-1, w), want)


def representable(k: int, w: int, seed: int) -> torch.Tensor:
    """[1, K] activations the int8 rounding keeps exactly: per sub-block of w elements, codes in
    [-127, 127] with one of magnitude 127, times a power of two."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (k // w, w), generator=g).float()
    q[:, 0] = 127.0 * (torch.randint(0, 2, (k // w,), generator=g) * 2 - 1)
    scale = 2.0 ** torch.randint(-9, -4, (k // w, 1), generator=g).float()
    return (q * scale).reshape(1, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("split", [1, 3])
def test_exact_activations_give_the_product(qtype: T, split: int) -> None:
    n, k = 37, 1024  # a ragged row tile; 4 or 8 chunks
    pw = pack(random_raw(qtype, n, k, seed=int(qtype) + split).to(DEVICE), qtype, (n, k))
    x = representable(k, _layout(qtype)[0], seed=split).to(DEVICE)
    want = x.double() @ unpack(pw).double().T
    tpr = 1 if split == 1 else 4  # threads a row: one, or four (Q6_K has four groups)
    cfg = {"BLOCK_N": 32 // tpr, "SPLIT_K": split, "num_warps": 1, "INT8": 1, "TPR": tpr}
    cfg["PREFETCH"] = split > 1  # (the interpreter runs one loop for both)
    got = packed_matmul(x, pw, torch.float32, config=cfg)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_rounding_in_the_prologue_gives_the_same_result(qtype: T, prefetch: int) -> None:
    """QX: each program rounds its split's activation chunks itself (no launch before the
    GEMV). The same codes and scales as the separate launch; the float sums of the sub-blocks
    (for the offsets) are reduced in the program's own layout, so on a GPU their last bits may
    differ (the H200 showed 1e-7 relative); the interpreter gives the same bits."""
    n, k = 37, 1024
    pw = pack(random_raw(qtype, n, k, seed=9).to(DEVICE), qtype, (n, k))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    cfg = {"BLOCK_N": 16, "SPLIT_K": 3, "num_warps": 2, "INT8": 1, "PREFETCH": prefetch}
    want = packed_matmul(x, pw, torch.float32, config=cfg)
    got = packed_matmul(x, pw, torch.float32, config={**cfg, "QX": 1})
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    exact = x.double() @ unpack(pw).double().T  # and it is the product (within the rounding)
    assert float((got.double() - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_N": 64, "num_warps": 2, "INT8": 1, "PREFETCH": 1},
        {"BLOCK_N": 8, "CH": 4, "num_warps": 4, "INT8": 1, "TILE": 1},  # packed_int8_tile
    ],
    ids=["rows", "tile"],
)
def test_random_activations_stay_within_the_rounding_bound(qtype: T, cfg: dict) -> None:
    n, k = 64, 1024
    pw = pack(random_raw(qtype, n, k, seed=5).to(DEVICE), qtype, (n, k))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    w = unpack(pw).double()
    want = x.double() @ w.T
    got = packed_matmul(x, pw, torch.float32, config=cfg)
    # each activation moves by at most half its sub-block's step: |error| <= |W| @ step / 2
    blocks = x.double().reshape(-1, _layout(qtype)[0])
    step = (blocks.abs().amax(1, keepdim=True) / 127).expand_as(blocks).reshape(1, k)
    bound = (step / 2) @ w.abs().T
    err = (got.double() - want).abs()
    assert bool((err <= bound * 1.001 + 1e-5).all()), float((err / bound).max())
    assert float((err / bound).mean()) < 0.5  # rounding errors cancel; a bias would not


@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu"])
@pytest.mark.parametrize("split", [1, 2])
def test_gated_epilogue(act: int, split: int) -> None:
    n, k = 38, 512
    pw = pack(random_raw(T.Q4_K, n, k, seed=act).to(DEVICE), T.Q4_K, (n, k))
    x = representable(k, 32, seed=act).to(DEVICE)
    cfg = {"BLOCK_N": 16, "SPLIT_K": split, "num_warps": 1, "INT8": 1, "TPR": 2}
    cfg["PREFETCH"] = split > 1
    got = packed_matmul(x, pw, torch.float32, cfg, act=act)
    y = x.double() @ unpack(pw).double().T
    g, u = y[:, 0::2], y[:, 1::2]
    want = (F.silu(g) if act == 1 else F.gelu(g, approximate="tanh")) * u
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_other_types_take_the_float_gemv() -> None:
    n, k = 16, 256
    pw = pack(random_raw(T.Q3_K, n, k, seed=2).to(DEVICE), T.Q3_K, (n, k))
    x = torch.randn(1, k, device=DEVICE)
    got = packed_matmul(x, pw, torch.float32, {"BLOCK_N": 16, "num_warps": 2, "INT8": 1})
    want = x.double() @ unpack(pw).double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
