"""The residual add + RMSNorm in a batch-1 GEMV's last program
(shared/kernels/qmatmul/norm_tail.py): the rows GEMV with the epilogue gives the new residual,
the normed row and its int8 roundings of the GEMV followed by ``norm.add_rms_norm_int8``: the
residual bit for bit, the normed row and codes bit for bit under the interpreter and within a
bfloat16 unit (a code within one) on a GPU, where the sum of squares may be added in another
order; unsplit and split K, one and two layouts, float32 and bfloat16; the counters are back
at zero; what it cannot take is refused.

Under TRITON_INTERPRET=1 the integer emulation runs; on a GPU the PTX."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.norm import add_rms_norm_int8
from shared.kernels.qmatmul.norm_tail import norm_tail
from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
N, K, EPS = 512, 512, 1e-5


def _inputs(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    pw = interleave(pack(random_raw(T.Q4_K, N, K, seed=seed).to(DEVICE), T.Q4_K, (N, K)))
    x = torch.randn(1, K, generator=g).to(dtype).to(DEVICE)
    residual = (4 * torch.randn(1, N, generator=g)).to(dtype).to(DEVICE)
    weight = (1 + torch.rand(N, generator=g)).to(DEVICE)
    return pw, x, residual, weight


def _close(got: torch.Tensor, want: torch.Tensor, unit: float = 2**-7) -> None:
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=unit, atol=1e-6)


def _codes(words: torch.Tensor) -> torch.Tensor:
    return words.view(torch.int8).int()


@pytest.mark.parametrize(
    ("split", "warps", "dtype", "layouts"),
    [
        (1, 16, torch.bfloat16, ((32, 8),)),
        (4, 4, torch.bfloat16, ((32, 8), (16, 16))),
        (2, 2, torch.float32, ((16, 16),)),
        (1, 4, torch.bfloat16, ()),
    ],
)
def test_the_epilogue_equals_the_norm_launch(split, warps, dtype, layouts) -> None:
    pw, x, residual, weight = _inputs(dtype, seed=split + warps)
    cfg = {"ROWS": 1, "INT8": 1, "num_warps": warps, "SPLIT_K": split}
    out = packed_matmul(x, pw, config=cfg)
    normed, new_res, rounded = add_rms_norm_int8(out, residual, weight, EPS, layouts)
    for _ in range(2):  # the second launch finds the counters at zero again
        tail = norm_tail(residual, weight, EPS, layouts)
        got = packed_matmul(x, pw, config=cfg, norm=tail)
        assert torch.equal(got, out)
        assert torch.equal(tail.new_residual, new_res)
        unit = 2**-7 if dtype == torch.bfloat16 else 2**-20
        _close(tail.normed, normed, unit)
        for layout in layouts:
            (gq, gd, gs), (wq, wd, ws) = tail.rounded[layout], rounded[layout]
            if DEVICE == "cpu":
                assert torch.equal(gq, wq) and torch.equal(gd, wd) and torch.equal(gs, ws)
            else:
                assert (_codes(gq) - _codes(wq)).abs().max().item() <= 1
                torch.testing.assert_close(gd, wd, rtol=unit, atol=0)
                torch.testing.assert_close(gs, ws, rtol=1e-2, atol=1e-2)
        assert not pw.tickets.any()


def test_what_the_epilogue_refuses() -> None:
    pw, x, residual, weight = _inputs(torch.bfloat16, seed=9)
    tail = norm_tail(residual, weight, EPS, ((32, 8),))
    with pytest.raises(ValueError, match="not the rows GEMV"):
        packed_matmul(x.expand(2, -1), pw, norm=tail)  # two rows
    with pytest.raises(ValueError, match="residual"):
        packed_matmul(x.float(), pw, norm=tail)  # float32 outputs, a bfloat16 residual
    with pytest.raises(ValueError, match="not whole chunks"):
        packed_matmul(x, pw, norm=norm_tail(residual, weight, EPS, ((32, 24),)))
    with pytest.raises(ValueError, match="at most two"):
        norm_tail(residual, weight, EPS, ((32, 8), (16, 16), (32, 8)))
