"""tools/bench_launch_floor.py: the chain of trivial kernels runs its links in order (under the
Triton interpreter here; the timing needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from tools.bench_launch_floor import _STRIDE, chain

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("programs", [1, 3])
def test_each_link_adds_one_to_the_one_before(programs: int) -> None:
    values = torch.zeros(6, _STRIDE, dtype=torch.int32, device=DEVICE)
    values[0, 0] = 10
    chain(values, programs, use_pdl=False)
    assert values[:, 0].tolist() == [10, 11, 12, 13, 14, 15]
    assert not values[:, 1:].any()  # each link writes its own word only
