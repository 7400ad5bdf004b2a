"""The CPU library's quantized matmuls (shared/model/native_linear.py over shared/cpu/qdot.c)
against the float64 product of the values they multiply: the activations as rounded
(RoundedActs.dequantize, per 32, or per 256 for the K-quants) by the weight as dequantized
(bit-exact with gguf). Every type, the
SIMD and portable C paths, row counts around the 4-row activation tiles and weight rows around
the 16-row blocks; the rounding itself; QuantLinear's choice of it; and the library built
without -march=native (no AVX2, no F16C: the C fallbacks other CPUs run)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from shared.cpu import native
from shared.model.linear import QuantLinear
from shared.model.native_linear import NativeWeight, RoundedActs, native_supported
from shared.quant import FP16_FIELDS, dequantize
from tests.test_dequant import sane_fp16

if native.load() is None:
    pytest.skip("no CPU library (SKIFF_CPU_NATIVE=0 or no C compiler)", allow_module_level=True)

TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
# (N, K): weight rows at and past the 16-row blocks, and not a multiple of them
SHAPES = ((16, 256), (17, 512), (37, 256), (37, 512))
ROWS = (1, 3, 4, 5, 9)  # activation rows around the 4-row tiles; 9 rounds them in threads
TOL = 1e-5  # of the sum of the products' magnitudes, |x| @ |W|.T


def random_raw(qtype: T, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, row bytes] random blocks with finite fp16 scales (subnormals among them)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        raw[:, off : off + 2] = sane_fp16(rng, raw.shape[0]).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def assert_rounded_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, block: int) -> None:
    """y [M, N] is RoundedActs(x, block) @ w.T: each value within TOL of its products'
    magnitudes."""
    xr = RoundedActs(x, block).dequantize().double()
    want, size = xr @ w.double().T, xr.abs() @ w.double().abs().T
    assert y.dtype == torch.float32 and y.shape == want.shape
    err = float(((y.double() - want).abs() / size.clamp_min(1e-300)).max())
    assert err <= TOL, err


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_is_the_rounded_product(qtype: T, shape: tuple[int, int]) -> None:
    n, k = shape
    raw = random_raw(qtype, n, k, seed=int(qtype) * 1000 + n + k)
    w = dequantize(raw, qtype, shape)
    weight = NativeWeight(raw, qtype, shape)
    g = torch.Generator().manual_seed(n + k)
    for m in ROWS:
        groups = torch.randn(m, k // 32, 32, generator=g) * torch.rand(m, k // 32, 1, generator=g)
        x = groups.view(m, k)  # groups of different scales
        simd, plain = weight.matmul(x, simd=True), weight.matmul(x, simd=False)
        assert_rounded_product(simd, x, w, weight.act_block)
        assert_rounded_product(plain, x, w, weight.act_block)
        torch.testing.assert_close(simd, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))
        # one rounding for several projections: the same bits as rounding here
        acts = RoundedActs(x, weight.act_block)
        assert torch.equal(weight.matmul(acts), simd)
        assert torch.equal(weight.matmul(acts, simd=False), plain)


@pytest.mark.parametrize("block", [32, 256])
def test_rounding_is_per_block_to_int8(block: int) -> None:
    """Per 32 for the legacy types, per 256 for the K-quants (llama.cpp's q8_K)."""
    g = torch.Generator().manual_seed(0)
    k, nb = 512, 512 // block
    x = torch.randn(3, k, generator=g) * 10.0 ** torch.randint(-6, 4, (3, k), generator=g)
    x[1] = 0.0  # a zero row
    x[2, block : 2 * block] = 0.0  # a zero block
    x[0, 0:block] = torch.linspace(-2.0, 2.0, block)  # its largest code: exactly ±127
    acts = RoundedActs(x, block)
    codes = acts.q.view(3, nb, block).int()
    scale = x.view(3, nb, block).abs().amax(-1) / 127
    assert acts.q.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert torch.equal(acts.d, scale)
    assert torch.equal(acts.s, acts.q.view(3, k // 16, 16).int().sum(-1))  # sums per 16
    step = acts.d[..., None].expand(3, nb, block).reshape(3, k)
    assert bool(((acts.dequantize() - x).abs() <= step * (0.5 + 1e-4)).all())  # half a step
    assert torch.equal(acts.dequantize()[1], torch.zeros(k))
    assert bool((codes[2, 1] == 0).all()) and float(acts.d[2, 1]) == 0.0


def test_a_k_quant_takes_activations_rounded_per_256() -> None:
    weight = NativeWeight(random_raw(T.Q4_K, 16, 256, seed=2), T.Q4_K, (16, 256))
    legacy = NativeWeight(random_raw(T.Q4_0, 16, 256, seed=3), T.Q4_0, (16, 256))
    assert weight.act_block == 256 and legacy.act_block == 32
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="rounded per 32"):
        weight.matmul(RoundedActs(x))
    assert torch.equal(weight.matmul(RoundedActs(x, 256)), weight.matmul(x))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_zero_rows_give_zeros(qtype: T) -> None:
    raw = random_raw(qtype, 20, 256, seed=7)
    weight = NativeWeight(raw, qtype, (20, 256))
    x = torch.randn(6, 256)
    x[[0, 4]] = 0.0  # one in each 4-row tile
    rest = [1, 2, 3, 5]
    for simd in (True, False):
        y = weight.matmul(x, simd=simd)
        assert torch.equal(y[[0, 4]], torch.zeros(2, 20))
        # a row's result is its own, whatever the rows tiled with it
        assert torch.equal(y[rest], weight.matmul(x[rest], simd=simd)) and bool(y[rest].any())


def test_a_weight_of_the_wrong_size_is_refused() -> None:
    raw = random_raw(T.Q4_0, 16, 256, seed=1)
    with pytest.raises(ValueError, match="are not"):
        NativeWeight(raw, T.Q4_0, (16, 512))


def test_quant_linear_multiplies_natively_where_it_can() -> None:
    assert native_supported(T.Q4_K, (48, 512)) and native_supported(T.Q8_0, (48, 96))
    assert not native_supported(T.Q2_K, (48, 512)) and not native_supported(T.F16, (48, 512))
    x = torch.randn(2, 3, 512)  # leading dimensions kept
    for qtype, native_kept in ((T.Q4_K, True), (T.Q2_K, False)):
        raw = random_raw(qtype, 48, 512, seed=int(qtype))
        layer = QuantLinear(raw, qtype, (48, 512), torch.float32, cpu_weights="native")
        assert isinstance(layer.native, NativeWeight) == native_kept
        want = F.linear(x, dequantize(raw, qtype, (48, 512)))
        got = layer(x)
        assert got.shape == (2, 3, 48) and got.dtype == torch.float32
        rel = float((got - want).norm() / want.norm())
        assert rel < 2e-2, (qtype.name, rel)  # int8 activations (Q4_K), a bf16 copy (Q2_K)


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The library built for any x86-64 (or this CPU's baseline): no AVX2, no F16C."""
    out = tmp_path_factory.mktemp("portable") / "skiff_portable.so"
    return native.compile_library(out, native=False)


def test_the_portable_build_multiplies_every_type(portable_lib: ctypes.CDLL) -> None:
    assert portable_lib.skiff_simd() == 0
    n, k, m = 37, 512, 5
    x = torch.randn(m, k)
    for qtype in TYPES:
        raw = random_raw(qtype, n, k, seed=int(qtype))
        row_bytes = raw.shape[1]
        y = torch.empty(m, n)
        portable_lib.skiff_matmul(
            int(qtype), raw.data_ptr(), row_bytes, n, k, x.data_ptr(), m, y.data_ptr(), n, 1
        )
        block = portable_lib.skiff_act_block(int(qtype))
        assert_rounded_product(y, x, dequantize(raw, qtype, (n, k)), block)
