"""The residual add and RMSNorm folded into the batch-1 rows GEMVs
(shared/kernels/qmatmul/norm_ahead.py):

- the producing GEMV's output is unchanged; the new residual is the norm launch's, bit for
  bit (``out + residual`` rounded to the activation dtype); each tile's sum of squares is
  that of its 32 rows; the rounding of ``h * w`` is the rounding launch's of the same float32
  products (codes and steps exact, sums up to order), for one layout, the other, and both;
  the split-K tickets are zero after;
- a GEMV whose activations await the norm's scale gives ``rstd`` times its product with the
  same rounding (``rstd`` from the tile sums), within float32: plain, the gated epilogue
  (the scale before the activation), the RoPE epilogue and the two-weight launch;
- both come within the int8 rounding's bound of the normed product in float64.

Under TRITON_INTERPRET=1 the integer emulation runs; on a GPU the PTX."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from shared.kernels.device import interpreted
from shared.kernels.norm import add_rms_norm_int8
from shared.kernels.qmatmul.int8_activations import (
    int8_buffers_for,
    int8_layout,
    prepare_int8,
    quantize_x_kernel,
)
from shared.kernels.qmatmul.norm_ahead import TILE, folds, norm_buffers
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_int8_pair import (
    gemv_int8_pair_kernel,
    pair_splits,
    rows_gemv_pair,
)
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import deinterleave, interleave
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
EPS = 1e-5
INTERP = interpreted(gemv_int8_pair_kernel)


def _weight(qtype: T, n: int, k: int, seed: int):
    return interleave(pack(random_raw(qtype, n, k, seed=seed).to(DEVICE), qtype, (n, k)))


def _cfg(split: int, warps: int = 2) -> dict:
    return {"ROWS": 1, "SPLIT_K": split, "num_warps": warps, "PREFETCH": int(split > 1)}


def _randn(*shape: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _rounded(y: torch.Tensor, w: int, g: int) -> tuple[torch.Tensor, ...]:
    """The rounding launch's (xq, xd, xs) of the float32 row y in layout (w, g)."""
    bufs = int8_buffers_for(y.numel(), w, g, y.device)
    quantize_x_kernel[(y.numel() // (w * g),)](y, *bufs, 0, 0, 0, W=w, G=g, PDL=False)
    return bufs


@pytest.mark.parametrize(
    "layouts", [((32, 8),), ((16, 16),), ((16, 16), (32, 8))], ids=["32", "16", "both"]
)
@pytest.mark.parametrize("split", [1, 4])
def test_the_epilogue_adds_sums_and_rounds(layouts: tuple, split: int) -> None:
    n, k = 512, 512
    iw = _weight(T.Q4_K, n, k, seed=split)
    x = _randn(1, k, seed=1)
    residual = _randn(1, n, seed=2) * 4
    weight = _randn(n, seed=3) + 1
    norm_out, made = norm_buffers(residual, weight, EPS, layouts)
    got = packed_matmul(x, iw, config=_cfg(split), norm_out=norm_out)
    assert torch.equal(got, packed_matmul(x, iw, config=_cfg(split)))
    _, h, _ = add_rms_norm_int8(got, residual, weight, EPS, ())  # the norm's launch
    assert torch.equal(norm_out.new_residual, h)
    tiles = h.float().reshape(-1, TILE)
    torch.testing.assert_close(norm_out.sums, (tiles * tiles).sum(1), rtol=1e-5, atol=0)
    y = (h.float() * weight.float()).reshape(-1)
    for layout in layouts:
        xq, xd, xs, sums, eps = made[layout]
        assert sums is norm_out.sums and eps == EPS
        want = _rounded(y, *layout)
        assert torch.equal(xq, want[0]) and torch.equal(xd, want[1]), layout
        torch.testing.assert_close(xs, want[2], rtol=1e-5, atol=1e-6 * want[2].abs().max())
    assert not iw.tickets.any()


def test_the_epilogue_refuses_what_it_cannot_fold() -> None:
    assert folds(4096, ((32, 8), (16, 16))) and folds(4096, ((32, 4),))
    assert not folds(4096, ()) and not folds(4096, ((32, 8),) * 3)
    assert not folds(4100, ((32, 8),)) and not folds(4096, ((64, 4),))
    iw = _weight(T.Q4_K, 64, 256, seed=0)
    x = _randn(1, 256, seed=0)
    norm_out, _ = norm_buffers(_randn(1, 32, seed=1), _randn(32, seed=2), EPS, ((16, 16),))
    with pytest.raises(ValueError, match="norm_out"):
        packed_matmul(x, iw, config=_cfg(1), act=1, norm_out=norm_out)
    with pytest.raises(ValueError, match="norm_out"):
        packed_matmul(x.expand(2, -1), iw, config=_cfg(1), norm_out=norm_out)


def _pending(h: torch.Tensor, weight: torch.Tensor, layout: tuple[int, int]):
    """The five-field rounding of ``h * weight`` awaiting the scale, and that scale (float64)."""
    hf = h.float().reshape(-1)
    sums = (hf.reshape(-1, TILE) ** 2).sum(1)
    rstd = torch.rsqrt(sums.sum() / hf.numel() + EPS).item()
    return (*_rounded(hf * weight.float(), *layout), sums, EPS), rstd


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("split", [1, 4])
def test_awaiting_the_scale_gives_rstd_times_the_product(qtype: T, split: int) -> None:
    n, k = 70, 1024  # a ragged row tile
    iw = _weight(qtype, n, k, seed=int(qtype))
    h, weight = _randn(1, k, seed=4) * 3, _randn(k, seed=5) + 1
    pending, rstd = _pending(h, weight, int8_layout(iw))
    got = packed_matmul(h, iw, torch.float32, _cfg(split), int8=pending)
    plain = packed_matmul(h, iw, torch.float32, _cfg(split), int8=pending[:3])
    torch.testing.assert_close(got, plain * rstd, rtol=1e-5, atol=1e-6 * plain.abs().max())
    # against the normed row's product in float64: within the int8 rounding
    normed = h.double() * weight.double() * rstd
    want = normed @ unpack(deinterleave(iw)).double().T
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 0.02, err


def test_the_gated_epilogue_scales_before_the_activation() -> None:
    n, k = 128, 512
    iw = _weight(T.Q4_K, n, k, seed=7)
    h, weight = _randn(1, k, seed=8), _randn(k, seed=9) + 1
    pending, rstd = _pending(h, weight, int8_layout(iw))
    got = packed_matmul(h, iw, torch.float32, _cfg(2), act=1, int8=pending)
    pairs = packed_matmul(h, iw, torch.float32, _cfg(2), int8=pending[:3]) * rstd
    want = F.silu(pairs[:, 0::2]) * pairs[:, 1::2]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max())


def test_the_pair_launch_scales_both_weights() -> None:
    k = 1024
    a, b = _weight(T.Q4_K, 70, k, seed=3), _weight(T.Q6_K, 45, k, seed=4)
    h, weight = _randn(1, k, seed=10) * 2, _randn(k, seed=11) + 1
    pa, rstd = _pending(h, weight, int8_layout(a))
    pb, _ = _pending(h, weight, int8_layout(b))
    pb = (*pb[:3], pa[3], EPS)  # one row: one set of sums
    s = pair_splits(a, b, 4)
    got = rows_gemv_pair(h, a, b, pa, pb, _cfg(4), s, INTERP)
    plain = rows_gemv_pair(h, a, b, pa[:3], pb[:3], _cfg(4), s, INTERP)
    for g, p in zip(got, plain, strict=True):
        p = p.float() * rstd
        torch.testing.assert_close(g.float(), p, rtol=1e-2, atol=1e-2 * p.abs().max())
    with pytest.raises(ValueError, match="both"):
        rows_gemv_pair(h, a, b, pa, pb[:3], _cfg(4), s, INTERP)


def test_prepare_int8_of_the_normed_row_is_close() -> None:
    """The folded rounding against the norm's (the normed row rounded): the products agree
    within the int8 rounding (the codes are rounded from different float values)."""
    n, k = 64, 512
    iw = _weight(T.Q4_K, n, k, seed=12)
    h, weight = _randn(1, k, seed=13) * 5, _randn(k, seed=14) + 1
    pending, rstd = _pending(h, weight, int8_layout(iw))
    got = packed_matmul(h, iw, torch.float32, _cfg(1), int8=pending)
    y = (h.float() * rstd * weight.float()).to(torch.bfloat16)
    want = packed_matmul(y, iw, torch.float32, _cfg(1), int8=prepare_int8(y, iw))
    err = ((got - want).norm() / want.norm()).item()
    assert err < 0.01, err
