"""The row-interleaved planes (shared/kernels/qmatmul/packed_rows.py) and the int8 GEMV that
reads them (packed_int8_rows.py):

- interleaving is a permutation: entry (r, e) lands where the layout says, and
  ``deinterleave`` gives the packed weight back exactly;
- the GEMV is ``x @ unpack(pw).T`` where the int8 rounding is exact, and equals
  ``packed_int8``'s result (same rounding, same integer sums) up to float32 summation order
  for random activations; ragged row tiles, splits, several chunks a warp, QX and the gated
  epilogue included.

Under TRITON_INTERPRET=1 the integer emulation runs; on a GPU the PTX."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.layout import ROWS, ROWS_TYPES
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import WIDE_MAXNREG, packed_matmul, wide_warps
from shared.kernels.qmatmul.packed_rows import deinterleave, interleave, unit
from tests.test_kernel_packed_int8 import _layout, representable
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
TYPES = sorted(ROWS_TYPES)


def _weight(qtype: T, n: int, k: int, seed: int):
    return pack(random_raw(qtype, n, k, seed=seed).to(DEVICE), qtype, (n, k))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_1, T.Q5_K], ids=lambda t: t.name)
def test_interleaving_is_the_documented_permutation(qtype: T) -> None:
    n, k = 45, 512  # a ragged second tile
    pw = _weight(qtype, n, k, seed=1)
    iw = interleave(pw)
    assert iw.rows32 and iw.shape == pw.shape
    for name in ("q", "hi", "sc", "mn", "d", "dmin"):
        plane = getattr(pw, name)
        if plane is None:
            assert getattr(iw, name) is None
            continue
        u, e = unit(pw, name), plane.shape[1]
        flat = getattr(iw, name).reshape(-1)
        assert flat.numel() == 64 * e  # rows padded to two tiles
        r = torch.arange(n).reshape(-1, 1)
        c = torch.arange(e).reshape(1, -1)
        at = (r // ROWS) * ROWS * e + ((c // u) * ROWS + r % ROWS) * u + c % u
        assert torch.equal(flat[at.reshape(-1).to(DEVICE)].reshape(n, e), plane), name
    back = deinterleave(iw)
    for name in ("q", "hi", "sc", "mn", "d", "dmin"):
        a, b = getattr(pw, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    with pytest.raises(ValueError, match="interleaved already"):
        interleave(iw)


def _cfg(split: int, warps: int, **extra: int) -> dict:
    return {"BLOCK_N": ROWS, "SPLIT_K": split, "num_warps": warps, "INT8": 1, "ROWS": 1, **extra}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("split", "warps"), [(1, 1), (2, 2), (1, 8), (1, 16)])
def test_exact_activations_give_the_product(qtype: T, split: int, warps: int) -> None:
    n, k = 37, 1536  # a ragged row tile; 6 or 12 chunks, uneven per split and warp
    pw = interleave(_weight(qtype, n, k, seed=int(qtype) + split))
    x = representable(k, _layout(qtype)[0], seed=split).to(DEVICE)
    want = x.double() @ unpack(deinterleave(pw)).double().T
    cap = {"MAXNREG": WIDE_MAXNREG} if warps == 16 else {}  # as wide_plan's programs
    got = packed_matmul(x, pw, torch.float32, config=_cfg(split, warps, PREFETCH=split > 1, **cap))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize(
    ("qtype", "qx"),
    [(T.Q4_K, 0), (T.Q4_K, 1), (T.Q6_K, 1), (T.Q8_0, 0), (T.Q4_0, 1)],
    ids=["Q4_K", "Q4_K-qx", "Q6_K-qx", "Q8_0", "Q4_0-qx"],
)
def test_random_activations_match_the_int8_gemv(qtype: T, qx: int) -> None:
    n, k = 40, 768
    pw = _weight(qtype, n, k, seed=5)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    want = packed_matmul(x, pw, torch.float32, config={"BLOCK_N": 16, "num_warps": 1, "INT8": 1})
    got = packed_matmul(x, interleave(pw), torch.float32, config=_cfg(3, 2, QX=qx))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("split", [1, 3])
def test_a_given_out_gets_the_product_in_its_dtype(split: int) -> None:
    """out= (the LM head's logits into a graph's float32 buffer): the same bits as the float32
    result the GEMV returns, and the bf16 one's within its rounding; other shapes refused."""
    n, k = 45, 768
    pw = interleave(_weight(T.Q6_K, n, k, seed=21))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(22)).to(DEVICE, torch.bfloat16)
    want = packed_matmul(x, pw, torch.float32, config=_cfg(split, 2))
    out = torch.full((1, n), float("nan"), device=DEVICE)
    assert packed_matmul(x, pw, config=_cfg(split, 2), out=out) is out
    assert torch.equal(out, want)
    rounded = packed_matmul(x, pw, config=_cfg(split, 2))  # within a bf16 step (the interpreter
    assert rounded.dtype == torch.bfloat16  # truncates where the GPU rounds to nearest)
    torch.testing.assert_close(rounded.float(), want, rtol=2**-7, atol=0)
    with pytest.raises(ValueError, match="out"):
        packed_matmul(x, pw, config=_cfg(split, 2), out=torch.empty(2, n, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        packed_matmul(x.expand(2, k), pw, config=_cfg(split, 2), out=torch.empty(2, n))


@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu"])
def test_gated_epilogue(act: int) -> None:
    n, k = 38, 512
    pw = _weight(T.Q4_K, n, k, seed=act)
    x = representable(k, 32, seed=act).to(DEVICE)
    got = packed_matmul(x, interleave(pw), torch.float32, _cfg(2, 1), act=act)
    y = x.double() @ unpack(pw).double().T
    g, u = y[:, 0::2], y[:, 1::2]
    want = (F.silu(g) if act == 1 else F.gelu(g, approximate="tanh")) * u
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("layout", [(16, 16), (32, 8)], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("split", [1, 4])
def test_gated_outputs_rounded_for_the_next_gemv(layout: tuple[int, int], split: int) -> None:
    """With out_int8 the gated rows GEMV also rounds its outputs for the next GEMV: the codes
    and steps of the separate rounding launch of the stored outputs, sums up to summation
    order; the outputs unchanged. A sub-block of 32 outputs spans two row tiles (the second
    to store rounds it); the split-K and pair counters are zero again afterwards."""
    from shared.kernels.qmatmul.int8_activations import int8_buffers_for, quantize_x_kernel

    n_out, k = 512, 512
    iw = interleave(_weight(T.Q4_K, 2 * n_out, k, seed=split))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(split)).to(DEVICE)
    w, g = layout
    bufs = int8_buffers_for(n_out, w, g, x.device)
    got = packed_matmul(x, iw, torch.bfloat16, _cfg(split, 2), act=1, out_int8=(*bufs, w, g))
    assert torch.equal(got, packed_matmul(x, iw, torch.bfloat16, _cfg(split, 2), act=1))
    want = int8_buffers_for(n_out, w, g, x.device)
    quantize_x_kernel[(n_out // (w * g),)](got[0], *want, 0, 0, 0, W=w, G=g, PDL=False)
    assert torch.equal(bufs[0], want[0]) and torch.equal(bufs[1], want[1])
    # float sums of 16 or 32 outputs in another order (the H200: 1.7e-6 relative in one of 32)
    torch.testing.assert_close(bufs[2], want[2], rtol=1e-5, atol=1e-6 * want[2].abs().max())
    assert not iw.tickets.any()
    with pytest.raises(ValueError, match="out_int8"):
        packed_matmul(x, iw, torch.bfloat16, _cfg(split, 2), out_int8=(*bufs, w, g))  # no act


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize(
    "cfg",
    [
        {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "SPLIT_K": 2},
        {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "WIDE": 1},
        {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "F16": 1},
        {"DEQUANT": 1},
    ],
    ids=["gemm", "wide", "f16", "dequant"],
)
def test_the_gemms_read_interleaved_planes_to_the_same_bits(qtype: T, cfg: dict) -> None:
    """Decode batches and prefill multiply an interleaved weight with the plain kernels, whose
    loads take the interleaved addresses (packed_chunk.entry): the same values in the same
    order, so the same bits."""
    n, k = 45, 512
    pw = _weight(qtype, n, k, seed=4)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    want = packed_matmul(x, pw, torch.float32, config=cfg)
    got = packed_matmul(x, interleave(pw), torch.float32, config=cfg)
    assert torch.equal(got, want)


def test_batch_one_configs_of_other_kernels_take_the_rows_gemv() -> None:
    """An untuned shape's default batch-1 config names another kernel: the rows GEMV runs with
    its own defaults; a batch-1 config cannot be used for more rows."""
    pw = _weight(T.Q4_K, 32, 256, seed=3)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cfg = {"BLOCK_N": 16, "num_warps": 1, "INT8": 1}
    want = packed_matmul(x, pw, torch.float32, config=cfg)
    got = packed_matmul(x, interleave(pw), torch.float32, config={"BLOCK_N": 16, "SPLIT_K": 1})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="interleaved"):
        packed_matmul(x.expand(2, -1), interleave(pw), config=cfg)


def test_wide_programs_load_all_their_chunks_in_one_wave() -> None:
    """packed_matmul.wide_warps on the H200's batch-1 Q4_K shapes (132 SMs): at 64 registers
    two 16-warp programs fit an SM, at 72 (WIDE_MAXNREG) one."""
    at64 = {16: 264, 8: 528}.__getitem__
    at72 = {16: 132, 8: 396}.__getitem__
    assert wide_warps(128, 16, at64) == 16  # 4096 x 4096: unsplit, one pass
    assert wide_warps(192, 16, at64) == 16  # 6144 x 4096 (q/k/v)
    assert wide_warps(192, 16, at72) is None  # ... not one wave at 72 registers
    assert wide_warps(64, 8, at64) == 8  # 2048 x 2048
    assert wide_warps(128, 56, at64) is None  # 4096 x 14336 (down): more chunks than warps
    assert wide_warps(128, 32, at64) is None  # Q6_K / Q8_0 4096 x 4096: 32 chunks
    assert wide_warps(32, 4, at64) is None  # the default four warps a program
