"""The int8-activation GEMV over one coalesced tile (``INT8: 1, TILE: 1``,
shared/kernels/qmatmul/packed_int8_tile.py) against the reference ``x @ unpack(pw).T``:
exact (up to float32 summation order) on activations the int8 rounding keeps, for every type,
with ragged row tiles, splits that leave the tile's last chunks empty, and the gated epilogue.
The rounding bound on random activations is tested beside the per-thread variant's
(tests/test_kernel_packed_int8.py), whose helpers these tests share."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.layout import INT8_TYPES
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from tests.test_kernel_packed_int8 import _layout, representable
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.mark.parametrize("qtype", sorted(INT8_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("ch", [3, 8])
def test_exact_activations_give_the_product(qtype: T, ch: int) -> None:
    # 37 rows: a ragged row tile. 1024 columns: 4 chunks (W = 32) or 8 (Q6_K, Q8_0). CH 3 with
    # 8 chunks: three programs of 3, 3 and 2 chunks in tiles of 4 (masked past each share);
    # with 4: two of 2. CH 8: one program over all of K.
    n, k = 37, 1024
    pw = pack(random_raw(qtype, n, k, seed=int(qtype) + ch).to(DEVICE), qtype, (n, k))
    x = representable(k, _layout(qtype)[0], seed=ch).to(DEVICE)
    want = x.double() @ unpack(pw).double().T
    cfg = {"BLOCK_N": 16, "CH": ch, "num_warps": 2, "INT8": 1, "TILE": 1}
    got = packed_matmul(x, pw, torch.float32, config=cfg)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu"])
def test_gated_epilogue(act: int) -> None:
    n, k = 38, 512
    pw = pack(random_raw(T.Q4_K, n, k, seed=act).to(DEVICE), T.Q4_K, (n, k))
    x = representable(k, 32, seed=act).to(DEVICE)
    cfg = {"BLOCK_N": 16, "CH": 1, "num_warps": 1, "INT8": 1, "TILE": 1}
    got = packed_matmul(x, pw, torch.float32, cfg, act=act)
    y = x.double() @ unpack(pw).double().T
    g, u = y[:, 0::2], y[:, 1::2]
    want = (F.silu(g) if act == 1 else F.gelu(g, approximate="tanh")) * u
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
