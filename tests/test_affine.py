"""The affine form of the 32-element-group types (shared/quant/affine.py): codes, scales and
offsets that give back gguf.quants' weights, random bytes included (any fp16 scale, NaN and inf
among them): bit for bit but for the sign of a zero and the payload of a NaN."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from shared.quant.affine import AFFINE_TYPES, affine
from tests.test_kernel_packed_matmul import random_raw


@pytest.mark.parametrize("qtype", sorted(AFFINE_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("sane", [True, False], ids=["scaled", "any-bytes"])
def test_scale_times_code_plus_offset_is_gguf(qtype: T, sane: bool) -> None:
    n, k = 16, 512
    raw = random_raw(qtype, n, k, seed=int(qtype), sane=sane)
    form = affine(raw, qtype, (n, k))
    assert form.codes.dtype == torch.uint8 and int(form.codes.max()) < 2**form.bits
    assert form.scale.shape == form.offset.shape == (n, k // 32)
    want = quants.dequantize(raw.numpy(), qtype).reshape(n, k)
    got = form.dequantize().numpy()
    np.testing.assert_array_equal(got, want.astype(np.float32))  # NaN at NaN, -0.0 == 0.0
    live = (got != 0) & ~np.isnan(got)
    np.testing.assert_array_equal(
        got.view(np.uint32)[live], want.astype(np.float32).view(np.uint32)[live]
    )


def test_other_types_and_ragged_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="Q6_K"):
        affine(torch.zeros(1, 210, dtype=torch.uint8), T.Q6_K, (1, 256))
    with pytest.raises(ValueError, match="multiple"):
        affine(torch.zeros(1, 18, dtype=torch.uint8), T.Q4_0, (1, 48))
