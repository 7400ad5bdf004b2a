"""The add + RMSNorm after the output projection in that GEMV's last program, inside the model
(``LlamaLayer.forward``, ``QuantLinear.forward_norm``, ``TritonOps.norm_tail``; the kernel:
tests/test_kernel_norm_tail.py).

The synthetic Llama of tests/test_qkv_rope_model.py (quantized by llama.cpp, planes interleaved
as CUDA keeps them) runs a prompt chunk and then token by token with the Triton ops: its logits
equal those with the norm a launch of its own (``ops_backend.NORM_TAIL`` off), and that launch
runs for the prompt chunk only (the one-token steps take the epilogue). Under
TRITON_INTERPRET=1 on the CPU, natively on CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import shared.model.ops_backend as ops_backend
from tests.test_logits import synthetic
from tests.test_qkv_rope_model import DEVICE, SPEC, STEPS, _decode, pytestmark  # noqa: F401

_INIT = ops_backend.TritonOps.__init__


class _Counting:
    """shared.kernels.norm with its add_rms_norm_int8 calls counted (rows a call)."""

    def __init__(self, module: object, rows: list[int]) -> None:
        self._module, self._rows = module, rows

    def add_rms_norm_int8(self, x, *args):
        self._rows.append(x.shape[0])
        return self._module.add_rms_norm_int8(x, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)


def _run(path: Path, tail: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, list]:
    monkeypatch.setattr(ops_backend, "NORM_TAIL", tail)
    rows: list[int] = []

    def counted(self) -> None:
        _INIT(self)
        self._norm = _Counting(self._norm, rows)

    monkeypatch.setattr(ops_backend.TritonOps, "__init__", counted)
    logits, _ = _decode(path, True, monkeypatch)
    return logits, rows


def test_decode_with_the_norm_in_the_gemv_equals_its_launch(
    synthetic_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = synthetic(SPEC, "Q4_K_M", synthetic_dir)
    apart, apart_rows = _run(path, False, monkeypatch)
    got, rows = _run(path, True, monkeypatch)
    prompt = apart_rows[0]
    # two add + RMSNorm launches a layer
    assert apart_rows == [prompt] * 2 * SPEC.n_layers + [1] * 2 * SPEC.n_layers * STEPS
    # the one-token steps leave the second norm of each layer to the output projection's GEMV
    assert rows == [prompt] * 2 * SPEC.n_layers + [1] * SPEC.n_layers * STEPS
    if DEVICE == "cpu":
        np.testing.assert_array_equal(got, apart)
    else:  # the sum of squares may be added in another order
        np.testing.assert_allclose(got, apart, atol=1e-2 * np.abs(apart).max(), rtol=0)
        assert (got.argmax(-1) == apart.argmax(-1)).all()
