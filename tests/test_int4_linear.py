"""The CPU's int4 planes (shared/model/int4_linear.py) against the float32 weight: one plane for
the 4-bit types, two for the 5- and 8-bit ones, each within the bf16 rounding of its scales,
activations and result; and the layers that keep float copies (other types, ragged shapes)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.model.int4_linear import Int4Weight, int4_supported
from shared.model.linear import QuantLinear
from shared.quant import dequantize
from shared.quant.affine import AFFINE_TYPES
from tests.test_kernel_packed_matmul import random_raw

pytestmark = pytest.mark.skipif(
    not int4_supported(T.Q4_0, (16, 32)), reason="torch has no CPU int4 GEMM here"
)


@pytest.mark.parametrize("qtype", sorted(AFFINE_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 5])
def test_planes_multiply_as_the_weight(qtype: T, m: int) -> None:
    n, k = 48, 512
    raw = random_raw(qtype, n, k, seed=int(qtype) + m)
    w = dequantize(raw, qtype, (n, k))
    int4 = Int4Weight(raw, qtype, (n, k))
    assert len(int4.planes) == (1 if AFFINE_TYPES[qtype] == 4 else 2)
    # the weight as the kernel sees it: each value within its bf16 scales' rounding
    seen = int4.dequantize()
    assert float(((seen - w).abs() - 2**-7 * w.abs().amax(1, keepdim=True)).max()) <= 0
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = x.double() @ w.double().T
    got = int4.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < 1e-2, rel  # bf16: 2^-9 relative per rounding


def test_quant_linear_keeps_planes_where_it_can() -> None:
    raw = random_raw(T.Q4_1, 32, 256, seed=1)
    layer = QuantLinear(raw, T.Q4_1, (32, 256), torch.float32, cpu_weights="int4")
    assert layer.int4 is not None and layer.raw is None and layer.dense_copy is None
    x = torch.randn(3, 256)
    ref = x @ dequantize(raw, T.Q4_1, (32, 256)).T
    assert float((layer(x) - ref).norm() / ref.norm()) < 1e-2
    # Q6_K (16-element scales) and 24 rows (not a multiple of 16) keep a bf16 copy instead
    for qtype, shape in ((T.Q6_K, (32, 256)), (T.Q4_1, (24, 256))):
        raw = random_raw(qtype, *shape, seed=2)
        other = QuantLinear(raw, qtype, shape, torch.float32, None, True, cpu_weights="int4")
        assert other.int4 is None and other.dense_copy.dtype == torch.bfloat16
        ref = x @ dequantize(raw, qtype, shape).T
        got = other(x)
        assert got.dtype == torch.float32 and float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_planes_built_in_row_chunks_are_the_whole_ones(
    qtype: T, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shared.model.int4_linear as int4_linear

    # the packing lays rows out in blocks of 64: chunks of whole blocks, and a ragged tail
    raw = random_raw(qtype, 208, 256, seed=3)
    whole = Int4Weight(raw, qtype, (208, 256))
    monkeypatch.setattr(int4_linear, "_CHUNK", 64)
    chunked = Int4Weight(raw, qtype, (208, 256))
    for (p, sz), (q, tz) in zip(whole.planes, chunked.planes, strict=True):
        assert torch.equal(p, q) and torch.equal(sz, tz)
