"""Two rows GEMVs of different types in one launch (shared/kernels/qmatmul/packed_int8_pair.py):

- each weight's result is bit-identical to its own rows GEMV launch (same rounded
  activations, same chunk split, same summation order), for ragged tiles, splits of several
  chunks and uneven per-weight chunk counts, and again on a second launch (the split-K tickets
  are back at zero);
- the split both weights take, or None when B's chunks cannot be cut into A's count;
- ``SplitLinear`` takes the paired launch at batch 1 when both parts run the rows GEMV on x
  rounded ahead, with the same outputs as one launch a part.

Under TRITON_INTERPRET=1 the integer emulation runs; on a GPU the PTX."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

import shared.model.linear as linear
from shared.kernels.device import interpreted
from shared.kernels.norm import add_rms_norm_int8
from shared.kernels.qmatmul.int8_activations import int8_layout, prepare_int8
from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_int8_pair import (
    gemv_int8_pair_kernel,
    pair_splits,
    rows_gemv_pair,
)
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from shared.model.linear import QuantLinear, SplitLinear
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
PAIRS = [(T.Q4_K, T.Q6_K), (T.Q8_0, T.Q5_K)]


def _weight(qtype: T, n: int, k: int, seed: int):
    return interleave(pack(random_raw(qtype, n, k, seed=seed).to(DEVICE), qtype, (n, k)))


def _cfg(split: int, warps: int, prefetch: bool) -> dict:
    return {"ROWS": 1, "SPLIT_K": split, "num_warps": warps, "PREFETCH": int(prefetch)}


@pytest.mark.parametrize(("ta", "tb"), PAIRS, ids=lambda t: t.name)
@pytest.mark.parametrize(("split", "warps"), [(1, 1), (4, 2)])
def test_each_result_is_its_own_launch_bit_for_bit(ta: T, tb: T, split: int, warps: int) -> None:
    k = 1024  # 4 chunks of 256 (Q4_K, Q5_K), 8 of 128 (Q6_K), 32 of 32 (Q8_0)
    a, b = _weight(ta, 70, k, seed=3), _weight(tb, 45, k, seed=4)  # ragged last tiles
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(split)).to(DEVICE)
    int8_a, int8_b = prepare_int8(x[0], a), prepare_int8(x[0], b)
    s = pair_splits(a, b, split)
    assert s == split
    cfg = _cfg(split, warps, prefetch=split > 1)
    for _ in range(2):  # the tickets are zero again after a launch
        got_a, got_b = rows_gemv_pair(x, a, b, int8_a, int8_b, cfg, s, interpreted(
            gemv_int8_pair_kernel))  # fmt: skip
        want_a = packed_matmul(x, a, config=cfg, int8=int8_a)
        want_b = packed_matmul(x, b, config=cfg, int8=int8_b)
        assert got_a.shape == (1, 70) and got_b.shape == (1, 45)
        assert torch.equal(got_a, want_a)
        assert torch.equal(got_b, want_b)
        assert not a.tickets.any() and not b.tickets.any()


def test_pair_splits() -> None:
    a, b = _weight(T.Q4_K, 32, 1024, 1), _weight(T.Q6_K, 32, 1024, 2)  # 4 and 8 chunks
    assert pair_splits(a, b, 4) == 4
    assert pair_splits(a, b, 3) == 2  # A's 4 chunks in splits of 2: two splits
    assert pair_splits(b, a, 8) is None  # A (Q6_K) in 8 slices, B (Q4_K) has 4 chunks
    assert pair_splits(b, a, 2) == 2


def _split_linear(k: int) -> SplitLinear:
    parts = []
    for qtype, n, seed in ((T.Q4_K, 96, 5), (T.Q6_K, 32, 6)):
        raw = random_raw(qtype, n, k, seed=seed).to(DEVICE)
        parts.append(QuantLinear(raw, qtype, (n, k), torch.float32, use_kernels=True, tuner=None))
        if not parts[-1].packed.rows32:  # the CPU keeps plain planes: interleave as CUDA does
            parts[-1].packed = interleave(parts[-1].packed)
    return SplitLinear(parts, [64, 32, 32])


def test_split_linear_pairs_its_parts_at_batch_one(monkeypatch: pytest.MonkeyPatch) -> None:
    k = 1024
    lin = _split_linear(k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    residual = torch.zeros_like(x)
    w = torch.ones(k, device=DEVICE)
    layouts = lin.int8_layouts(1)
    assert layouts == tuple(sorted({int8_layout(p.packed) for p in lin.parts}))
    assert len(layouts) == 2
    normed, _, rounded = add_rms_norm_int8(x, residual, w, 1e-6, layouts)
    calls = []
    real = linear.rows_gemv_pair
    monkeypatch.setattr(linear, "rows_gemv_pair", lambda *a: calls.append(1) or real(*a))
    paired = lin(normed, rounded)
    assert calls == [1]
    q, k = torch.split(lin.parts[0](normed, rounded), [64, 32], dim=-1)  # one launch a part
    apart = (q, k, lin.parts[1](normed, rounded))
    assert len(paired) == len(apart) == 3
    # q/k bit for bit; v took q/k's split (one, where its own is two): float32 summation order
    assert torch.equal(paired[0], apart[0]) and torch.equal(paired[1], apart[1])
    torch.testing.assert_close(paired[2], apart[2], rtol=1e-5, atol=1e-4)
    assert lin(normed, None) is not None  # not rounded ahead: one launch a part
    assert calls == [1]
