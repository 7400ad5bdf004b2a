"""The rows GEMV over a few activation rows (shared/kernels/qmatmul/packed_int8_rows_batch.py):
each row's result equals the batch-1 rows GEMV's for that row alone (the same rounding, the
same integer sums) up to float32 summation order, for every rows type; ragged row tiles,
row groups (MR below M, a last group past M), split-K and the gated epilogue included; where
the int8 rounding is exact it is ``x @ unpack(pw).T``.

Under TRITON_INTERPRET=1 the integer emulation runs; on a GPU the PTX, and Llama-3-8B shapes."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.layout import ROWS_TYPES
from shared.kernels.qmatmul.packed import unpack
from shared.kernels.qmatmul.packed_int8_rows_batch import BATCH_ROWS, batch_config
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import deinterleave, interleave
from tests.spies import record_results
from tests.test_kernel_packed_int8 import _layout, representable
from tests.test_kernel_packed_int8_rows import _weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
TYPES = sorted(ROWS_TYPES)
# the CPU tier (tests/tiers.py): every type with several programs down M and a split K, the
# one-program form (MR = M) for Q4_K only (the types differ in the code the batch-1 rows GEMV
# shares, tested for every type in test_kernel_packed_int8_rows.py)
CPU_TIER = {"test_rows_equal_the_rows_gemv_of_each": lambda p: p["m"] == 5 or p["qtype"] == T.Q4_K}


def _cfg(mr: int, split: int, warps: int) -> dict:
    return {"ROWS": 1, "MR": mr, "SPLIT_K": split, "num_warps": warps}


def _one_by_one(x: torch.Tensor, pw, act: int = 0) -> torch.Tensor:
    """The batch-1 rows GEMV row by row (split 1: its own summation order)."""
    one = {"ROWS": 1, "SPLIT_K": 1, "num_warps": 2}
    return torch.cat([packed_matmul(r[None], pw, torch.float32, config=one, act=act) for r in x])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "mr", "split", "warps"), [(3, 3, 1, 2), (5, 2, 2, 1)])
def test_rows_equal_the_rows_gemv_of_each(qtype: T, m: int, mr: int, split: int, warps: int):
    n, k = 45, 1024  # a ragged row tile; 4 or 8 chunks
    pw = interleave(_weight(qtype, n, k, seed=int(qtype) + m))
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    got = packed_matmul(x, pw, torch.float32, config=_cfg(mr, split, warps))
    want = _one_by_one(x, pw)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_exact_activations_give_the_product(qtype: T) -> None:
    n, k, m = 37, 1536, 4
    pw = interleave(_weight(qtype, n, k, seed=7))
    x = torch.cat([representable(k, _layout(qtype)[0], seed=s) for s in range(m)]).to(DEVICE)
    want = x.double() @ unpack(deinterleave(pw)).double().T
    got = packed_matmul(x, pw, torch.float32, config=_cfg(4, 2, 2))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_gated_rows(qtype: T) -> None:
    n, k, m = 64, 512, 3  # 32 gate/up pairs
    pw = interleave(_weight(qtype, n, k, seed=11))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = packed_matmul(x, pw, torch.float32, config=_cfg(2, 2, 2), act=1)
    want = _one_by_one(x, pw, act=1)
    assert got.shape == (m, n // 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_default_path_takes_it_up_to_batch_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a config, 2 .. BATCH_ROWS rows of an interleaved weight run this kernel (at most
    BATCH_MR rows a program, the groups even), one row and more rows the other kernels; the
    tickets are back at zero after a split launch."""
    pm = importlib.import_module("shared.kernels.qmatmul.packed_matmul")  # not the function

    assert [batch_config(None, m)["MR"] for m in (2, 3, 4, 5, 6, 8)] == [2, 3, 4, 3, 3, 4]
    assert all("MAXNREG" not in batch_config(None, m) for m in (2, 3, 4))  # the compiler's
    seen: list[int] = []
    real = pm.launch_int8_rows_batch

    def spy(x, pw, out, cfg, act, interp, int8=None):
        seen.append(x.shape[0])
        real(x, pw, out, cfg, act, interp, int8)

    monkeypatch.setattr(pm, "launch_int8_rows_batch", spy)
    pw = interleave(_weight(T.Q4_K, 64, 512, seed=5))
    x = torch.randn(BATCH_ROWS + 1, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for m in (1, BATCH_ROWS):  # the int8 GEMVs' rounding
        got = packed_matmul(x[:m], pw, torch.float32)
        torch.testing.assert_close(got, _one_by_one(x[:m], pw), rtol=1e-5, atol=1e-4)
    got = packed_matmul(x, pw, torch.float32)  # a GEMM's: unrounded activations
    torch.testing.assert_close(got, x @ unpack(pw).T, rtol=1e-5, atol=1e-3)
    assert seen == [BATCH_ROWS]
    assert int(pw.tickets.abs().sum()) == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="Llama-3-8B shapes: GPU only")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_llama_shapes(qtype: T, n: int, k: int, m: int) -> None:
    pw = interleave(_weight(qtype, n, k, seed=m))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    got = packed_matmul(x, pw, torch.float32, config=batch_config(pw, m))
    want = _one_by_one(x, pw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_programs_an_sm_holds() -> None:
    """CUDA's occupancy rule on an H200's SM (65,536 registers, 2,048 threads, 228 KB): the batch
    rows GEMV's register counts for sm_90 (tools/kernel_sass: Q4_K 72 at 1 row, 92 at 2, 148
    at 4) give 7, 5 and 3 programs of 4 warps; threads and shared memory bound it too."""
    from shared.kernels.device import programs_per_sm

    sm = (65536, 2048, 233472)
    assert [programs_per_sm(r, 4, 0, *sm) for r in (72, 92, 148, 32)] == [7, 5, 3, 16]
    assert programs_per_sm(92, 4, 100 << 10, *sm) == 2  # two programs' shared memory
    assert programs_per_sm(255, 8, 0, *sm) == 1
    assert programs_per_sm(0, 1, 0, *sm) == 32  # no register count: the 32-program limit


def test_one_wave_split() -> None:
    from shared.kernels.qmatmul.packed_int8_rows_batch import wave_split

    # 192 row tiles of 6144 rows, 5 programs an SM on 132 SMs: 660 a wave, 3 splits of 192
    assert wave_split(4, 192, 5, 132) == 3
    assert wave_split(2, 192, 5, 132) == 2  # never more than asked
    assert wave_split(7, 128, 3, 132) == 3  # 4096x14336 at 4 rows
    assert wave_split(1, 896, 5, 132) == 1 and wave_split(4, 5000, 1, 132) == 1


def test_one_wave_takes_the_compiled_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a SPLIT_K the split is cut to one wave of programs as the compiled kernel's
    registers allow, found at a launch form's first call and kept on the weight; the product
    is unchanged (to summation order). The interpreter has no registers: there it keeps
    batch_split's count."""
    rb = importlib.import_module("shared.kernels.qmatmul.packed_int8_rows_batch")
    seen = record_results(monkeypatch, rb, "wave_split")
    n, k, m = 6144, 4096, 2
    if DEVICE != "cuda":
        n, k = 64, 1024
    pw = interleave(_weight(T.Q4_K, n, k, seed=5))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cfg = batch_config(pw, m)
    got = packed_matmul(x, pw, torch.float32, config=cfg)
    want = _one_by_one(x, pw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert int(pw.tickets.abs().sum()) == 0
    if DEVICE == "cuda":
        assert len(seen) == 1 and 1 <= seen[0] <= rb.batch_split(pw, 1, 4)
        assert list(pw.wave_splits.values()) == seen
        again = packed_matmul(x, pw, torch.float32, config=cfg)  # the kept split: no lookup
        assert len(seen) == 1
        torch.testing.assert_close(again, got, rtol=0, atol=0)
    else:
        assert seen == [] and pw.wave_splits == {}
