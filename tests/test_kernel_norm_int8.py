"""RMSNorm with the int8 rounding of its row in the same launch (shared.kernels.norm
.add_rms_norm_int8): the normed row and the residual are add_rms_norm's (rms_norm's without a
residual), and the codes, steps and sums are those int8_activations.prepare_int8 makes of the
normed row for each weight's layout. On CUDA, or on the CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from shared.kernels import norm
from shared.kernels.norm import add_rms_norm, add_rms_norm_int8, rms_norm
from shared.kernels.qmatmul.int8_activations import int8_layout, prepare_int8
from shared.kernels.qmatmul.packed import pack
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


# 768: a row padded to a block of 1024; 1536: three programs of 512 columns (norm._slice)
@pytest.mark.parametrize("n", [512, 768, 1536])
@pytest.mark.parametrize(
    "types", [(T.Q4_K,), (T.Q4_K, T.Q6_K), (T.Q8_0,)], ids=lambda ts: "+".join(t.name for t in ts)
)
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first"])
def test_rounding_in_the_norm_is_the_separate_rounding(residual, types, n) -> None:
    g = torch.Generator().manual_seed(n + len(types))
    x, r = (torch.randn(1, n, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    w = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16)
    pws = [pack(random_raw(t, 32, n, seed=i).to(DEVICE), t, (32, n)) for i, t in enumerate(types)]
    layouts = tuple(int8_layout(pw) for pw in pws)
    normed, new_res, rounded = add_rms_norm_int8(x, r if residual else None, w, EPS, layouts)
    want, want_res = add_rms_norm(x, r, w, EPS) if residual else (rms_norm(x, w, EPS), x)
    assert torch.equal(normed, want) and torch.equal(new_res, want_res)
    assert set(rounded) == set(layouts)
    for pw, layout in zip(pws, layouts, strict=True):
        xq, xd, xs = rounded[layout]
        wq, wd, ws = prepare_int8(normed[0], pw)
        assert torch.equal(xq, wq) and torch.equal(xd, wd)
        torch.testing.assert_close(xs, ws, rtol=1e-6, atol=1e-6)  # summation order


@pytest.mark.parametrize("rows", [2, 3, 4])
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first"])
def test_a_few_rows_are_each_rounded_as_alone(rows: int, residual: bool) -> None:
    """2-4 rows (the batch rows GEMV's): [rows, ...] buffers, each row's codes, steps and sums
    those prepare_int8 makes of the batch (its rows one by one), for two layouts at once."""
    g = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 1536, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    w = torch.randn(1536, generator=g).to(DEVICE, torch.bfloat16)
    pws = [pack(random_raw(t, 32, 1536, seed=i).to(DEVICE), t, (32, 1536))
           for i, t in enumerate((T.Q4_K, T.Q6_K))]  # fmt: skip
    layouts = tuple(int8_layout(pw) for pw in pws)
    normed, _, rounded = add_rms_norm_int8(x, r if residual else None, w, EPS, layouts)
    want = add_rms_norm(x, r, w, EPS)[0] if residual else rms_norm(x, w, EPS)
    assert torch.equal(normed, want) and set(rounded) == set(layouts)
    for pw, layout in zip(pws, layouts, strict=True):
        xq, xd, xs = rounded[layout]
        wq, wd, ws = prepare_int8(normed, pw)  # [rows, ...]: one launch over the rows
        assert xq.shape == wq.shape == (rows, 1536 // 4) and xd.shape == wd.shape
        assert torch.equal(xq, wq) and torch.equal(xd, wd)
        torch.testing.assert_close(xs, ws, rtol=1e-6, atol=1e-6)  # summation order


def test_rounding_only_for_a_few_rows_and_whole_chunks() -> None:
    x = torch.randn(norm.ROUND_ROWS + 1, 512, device=DEVICE)
    w = torch.ones(512, device=DEVICE)
    normed, _, rounded = add_rms_norm_int8(x, x, w, EPS, ((32, 8),))
    assert rounded == {} and torch.equal(normed, add_rms_norm(x, x, w, EPS)[0])
    with pytest.raises(ValueError, match="at most two"):
        add_rms_norm_int8(x[:1], None, w, EPS, ((32, 8), (16, 8), (32, 4)))
    with pytest.raises(ValueError, match="whole chunks"):
        add_rms_norm_int8(x[:1, :384], None, w[:384], EPS, ((32, 8),))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_row_over_programs_equals_one_program(rows: int, monkeypatch) -> None:
    """Decode rows spread over programs of 512 columns: bit-equal to one program a row (every
    program sums the whole row's squares in the same order), the int8 codes and scales too."""
    g = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 2048, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    w = torch.randn(2048, generator=g).to(DEVICE, torch.bfloat16)
    assert norm._slice(rows, 2048, ((32, 8), (16, 16))) == (512, 4)
    sliced = add_rms_norm_int8(x, r, w, EPS, ((32, 8), (16, 16)))
    plain = rms_norm(x, w, EPS)
    monkeypatch.setattr(norm, "_SLICED_ROWS", 0)
    assert norm._slice(rows, 2048, ()) == (2048, 1)
    whole = add_rms_norm_int8(x, r, w, EPS, ((32, 8), (16, 16)))
    assert torch.equal(sliced[0], whole[0]) and torch.equal(sliced[1], whole[1])
    assert torch.equal(plain, rms_norm(x, w, EPS))
    assert sliced[2].keys() == whole[2].keys()
    for layout, (xq, xd, xs) in whole[2].items():
        assert torch.equal(sliced[2][layout][0], xq) and torch.equal(sliced[2][layout][1], xd)
        # the sub-blocks' float sums follow the tile's register layout ([SLICE / W, W] against
        # [N / W, W]): compiled, one of 3 x 128 sums differed in its last bit on the H200
        torch.testing.assert_close(sliced[2][layout][2], xs, rtol=1e-6, atol=1e-6)
