"""shared.kernels.argmax against torch.argmax: first index of the maximum, NaN above all."""

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from shared.kernels.argmax import argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _counts(rows: int = 8) -> torch.Tensor:
    return torch.zeros(rows, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 17, 4096, 3 * 4096 + 5])
def test_argmax_rows_equals_torch(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g).to(dtype)
    if n > 1:
        x[1, n // 3] = x[1, n - 1] = 50.0  # a tie: the first wins
        x[2] = -float("inf")  # all -inf: index 0
        x[3, n - 1] = float("nan")  # NaN wins over the maximum
        x[4, n // 2] = float("inf")
        x[5, n - 1] = x[5, n // 2] = float("nan")  # the first NaN
    x = x.to(DEVICE)
    counts = _counts()
    want = x.float().cpu().argmax(dim=-1).tolist()
    for _ in range(2):  # the launch leaves its counts zero for the next
        got = argmax_rows(x, counts)
        assert got.dtype == torch.int64 and got.shape == (6,)
        assert got.tolist() == want
        assert not counts.any()
    # the picks stored into host memory too (pinned on a GPU: the step's ids, no copy)
    host = torch.full((6,), -1, dtype=torch.int64)
    host = host.pin_memory() if DEVICE == "cuda" else host
    got = argmax_rows(x, counts, host)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert got.tolist() == want and host.tolist() == want


def test_argmax_rows_on_a_strided_view_and_bad_input():
    x = torch.randn(8, 9000).to(DEVICE)
    assert argmax_rows(x[:, ::2], _counts()).tolist() == x[:, ::2].cpu().argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(torch.zeros(3, dtype=torch.int64), _counts())
    with pytest.raises(ValueError, match="counts"):  # fewer counters than rows
        argmax_rows(x, _counts(4))
    with pytest.raises(ValueError, match="host"):  # a host tensor of the wrong shape or dtype
        argmax_rows(x, _counts(), torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="host"):
        argmax_rows(x, _counts(), torch.zeros(8, dtype=torch.int32))
