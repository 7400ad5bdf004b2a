"""Bit-exactness of shared.quant.dequantize against gguf.quants.dequantize.

"Bit-identical" means: every non-NaN output has exactly gguf's float32 bits (so -0.0 and
+0.0 are told apart), and NaN appears at exactly gguf's positions. NaN payloads are not
compared: numpy keeps a half NaN's payload (even a signalling one) while torch quiets or
canonicalises it depending on the code path and device, and NaN arithmetic propagates
payloads differently per backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from shared.quant import (
    FP16_FIELDS,
    SUPPORTED_TYPES,
    UnsupportedTensorType,
    block_geometry,
    dequantize,
)

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
LEGACY_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
BLOCK_TYPES = LEGACY_TYPES + K_TYPES
ALL_TYPES = FLOAT_TYPES + BLOCK_TYPES


N_ROWS = 6
BLOCKS_PER_ROW = 12  # 72 blocks per case


def assert_same_bits(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    got = ours.detach().cpu().numpy()
    ref = np.asarray(ref, dtype=np.float32)
    assert got.shape == ref.shape
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg="NaN positions differ")
    bad = np.flatnonzero(got.view(np.uint32)[~nan] != ref.view(np.uint32)[~nan])
    assert bad.size == 0, (
        f"{bad.size} values differ, first: ours={got[~nan][bad[0]]!r} gguf={ref[~nan][bad[0]]!r}"
    )


def gguf_reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, qtype)


def sane_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite fp16 values spanning signs, zeros, subnormals and the usual scale range."""
    magnitude = 10.0 ** rng.uniform(-5, 2, n)
    tiny = rng.choice(np.array([6e-8, 1.2e-7, 3e-6, 6.1e-5, 0.0], dtype=np.float32), n)
    values = np.where(rng.random(n) < 0.15, tiny, magnitude)
    values = values * rng.choice(np.array([-1.0, 1.0]), n)
    return values.astype(np.float16)


def random_blocks(qtype: T, rng: np.random.Generator, *, sane_scales: bool) -> np.ndarray:
    """``(N_ROWS, bytes_per_row)`` raw bytes: random payload, optionally sane fp16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = N_ROWS * BLOCKS_PER_ROW
    if qtype in FLOAT_TYPES:
        n_blocks *= 32  # float "blocks" are single elements
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if sane_scales:
        for off in FP16_FIELDS.get(qtype, ()):
            raw[:, off : off + 2] = sane_fp16(rng, n_blocks).view(np.uint8).reshape(-1, 2)
    return raw.reshape(N_ROWS, -1)


def plant_specials(raw: np.ndarray, qtype: T) -> None:
    """Write inf/-inf/NaN into the leading fp16 scale (or float element) of a few blocks."""
    specials = np.array([np.inf, -np.inf, np.nan], dtype=np.float16).view(np.uint8)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype == T.BF16:
        specials = np.array([0x7F80, 0xFF80, 0x7FC1], dtype=np.uint16).view(np.uint8)
    elif qtype == T.F32:
        specials = np.array([np.inf, -np.inf, np.nan], dtype=np.float32).view(np.uint8)
    off = FP16_FIELDS.get(qtype, (0,))[0]
    width = specials.size // 3
    for i, k in enumerate((1, 5, 9)):
        blocks[k, off : off + width] = specials[i * width : (i + 1) * width]


def logical_shape(raw: np.ndarray, qtype: T) -> tuple[int, ...]:
    return gguf.quants.quant_shape_from_byte_shape(raw.shape, qtype)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_sane_scales(qtype: T) -> None:
    raw = random_blocks(qtype, np.random.default_rng(int(qtype)), sane_scales=True)
    ref = gguf_reference(raw, qtype)
    assert np.isfinite(ref).all()
    shape = logical_shape(raw, qtype)
    # Both accepted input layouts: [rows, bytes_per_row] and flat.
    assert_same_bits(dequantize(torch.from_numpy(raw), qtype, shape), ref)
    assert_same_bits(dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype), shape), ref)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_fully_random_bytes(qtype: T) -> None:
    # Random fp16/bf16/f32 bit patterns include inf and NaN; those must land where gguf's do.
    raw = random_blocks(qtype, np.random.default_rng(1000 + int(qtype)), sane_scales=False)
    plant_specials(raw, qtype)
    ref = gguf_reference(raw, qtype)
    assert np.isnan(ref).any() and np.isinf(ref).any(), "case should exercise inf/NaN"
    assert_same_bits(dequantize(torch.from_numpy(raw), qtype, logical_shape(raw, qtype)), ref)


@pytest.mark.parametrize("qtype", LEGACY_TYPES + (T.BF16,), ids=lambda t: t.name)
def test_quantize_roundtrip(qtype: T) -> None:
    rng = np.random.default_rng(7 + int(qtype))
    weights = (rng.standard_normal((16, 512)) * 10.0 ** rng.uniform(-3, 1, (16, 1))).astype(
        np.float32
    )
    raw = gguf.quants.quantize(weights, qtype).view(np.uint8)
    ref = gguf_reference(raw, qtype)
    out = dequantize(torch.from_numpy(raw), qtype, weights.shape)
    assert_same_bits(out, ref)
    # Sanity that the round trip is a real dequantization, not just self-consistent.
    assert np.abs(out.numpy() - weights).max() <= np.abs(weights).max() * 0.1


def test_f16_specials_and_multidim_shape() -> None:
    values = np.array([0.0, -0.0, 1.0, -2.5, 6e-8, -6e-8, 65504.0, np.inf, -np.inf, np.nan])
    half = np.resize(values.astype(np.float16), 2 * 3 * 32)
    raw = half.view(np.uint8)
    out = dequantize(torch.from_numpy(raw), T.F16, (2, 3, 32))
    assert_same_bits(out, gguf_reference(raw, T.F16).reshape(2, 3, 32))


def test_k_quant_multidim_shape() -> None:
    raw = random_blocks(T.Q4_K, np.random.default_rng(3), sane_scales=True)
    ref = gguf_reference(raw, T.Q4_K)
    out = dequantize(torch.from_numpy(raw), T.Q4_K, (2, 3, ref.shape[-1]))
    assert_same_bits(out, ref.reshape(2, 3, -1))


@pytest.mark.parametrize("qtype", (T.F32, T.F16, T.Q4_0, T.Q6_K), ids=lambda t: t.name)
def test_misaligned_slice_of_larger_buffer(qtype: T) -> None:
    # Weights may be a view into a bigger (mmapped) buffer at an arbitrary byte offset.
    raw = random_blocks(qtype, np.random.default_rng(11), sane_scales=True).reshape(-1)
    backing = torch.zeros(raw.size + 3, dtype=torch.uint8)
    backing[1 : 1 + raw.size] = torch.from_numpy(raw)
    out = dequantize(
        backing[1 : 1 + raw.size], qtype, logical_shape(raw.reshape(N_ROWS, -1), qtype)
    )
    assert_same_bits(out, gguf_reference(raw.reshape(N_ROWS, -1), qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_empty_and_single_block(qtype: T) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    empty = dequantize(torch.zeros(0, dtype=torch.uint8), qtype, (0, block_size))
    assert empty.shape == (0, block_size) and empty.dtype == torch.float32
    # One block: column slices of a (1, type_size) matrix count as contiguous in torch,
    # so this exercises the odd-offset dtype views that many blocks never hit.
    raw = random_blocks(qtype, np.random.default_rng(5), sane_scales=True)[:1, :type_size]
    assert_same_bits(
        dequantize(torch.from_numpy(raw), qtype, (1, block_size)), gguf_reference(raw, qtype)
    )


def test_float_dtype_input_is_read_as_raw_bytes() -> None:
    # GGUFReader hands F32/F16 tensors out with their float dtype rather than as bytes.
    values = np.random.default_rng(9).standard_normal((3, 64)).astype(np.float32)
    out = dequantize(torch.from_numpy(values), T.F32, values.shape)
    assert_same_bits(out, values)
    half = values.astype(np.float16)
    assert_same_bits(dequantize(torch.from_numpy(half), T.F16, half.shape), half.astype(np.float32))


def test_supported_types_and_geometry() -> None:
    assert frozenset(ALL_TYPES) == SUPPORTED_TYPES
    assert block_geometry(T.Q4_K) == (256, 144)
    assert block_geometry(int(T.Q8_0)) == (32, 34)
    assert block_geometry(T.F16) == (1, 2)
    assert block_geometry(T.IQ2_XXS) == GGML_QUANT_SIZES[T.IQ2_XXS]
    with pytest.raises(UnsupportedTensorType, match="9999"):
        block_geometry(9999)


@pytest.mark.parametrize("qtype", (T.IQ2_XXS, T.TQ1_0, T.IQ4_NL), ids=lambda t: t.name)
def test_unsupported_type_raises(qtype: T) -> None:
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = torch.zeros(type_size, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorType, match=qtype.name):
        dequantize(data, qtype, (GGML_QUANT_SIZES[qtype][0],))
    with pytest.raises(UnsupportedTensorType, match=qtype.name):
        dequantize(data, int(qtype), (GGML_QUANT_SIZES[qtype][0],))


def test_unknown_type_id_raises() -> None:
    with pytest.raises(UnsupportedTensorType, match="9999"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 9999, (1,))


@pytest.mark.parametrize("qtype", (T.F32, T.Q4_1, T.Q6_K), ids=lambda t: t.name)
def test_wrong_byte_count_raises(qtype: T) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = (4, block_size * 8)
    good = torch.zeros(4 * 8 * type_size, dtype=torch.uint8)
    assert dequantize(good, qtype, shape).shape == shape
    for bad in (good[:-1], torch.zeros(good.numel() + type_size, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="bytes") as info:
            dequantize(bad, qtype, shape)
        assert not isinstance(info.value, UnsupportedTensorType)


def test_row_not_multiple_of_block_raises() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(torch.zeros(18 * 3, dtype=torch.uint8), T.Q4_0, (3, 32 + 16))


# --- real GGUF files -------------------------------------------------------------------

MAX_ROWS = 2048  # cap on rows compared per tensor, to keep huge embeddings cheap


def _reader_from_env(var: str) -> gguf.GGUFReader:
    path = os.environ.get(var)
    if not path:
        pytest.skip(f"{var} is not set")
    if not Path(path).is_file():
        pytest.skip(f"{var}={path} does not exist")
    return gguf.GGUFReader(path)


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    return _reader_from_env("SKIFF_SMOLLM2")


@pytest.fixture(scope="module")
def gemma3_reader() -> gguf.GGUFReader:
    return _reader_from_env("SKIFF_GEMMA3")


REAL_CASES = [
    ("smollm2_reader", T.Q4_1),
    ("smollm2_reader", T.Q8_0),
    ("smollm2_reader", T.F32),
    ("gemma3_reader", T.Q5_0),
    ("gemma3_reader", T.Q4_K),
    ("gemma3_reader", T.Q6_K),
    ("gemma3_reader", T.Q8_0),
    ("gemma3_reader", T.F32),
]


@pytest.mark.parametrize(
    ("reader_fixture", "qtype"),
    REAL_CASES,
    ids=[f"{r.split('_')[0]}-{t.name}" for r, t in REAL_CASES],
)
def test_real_tensors(request: pytest.FixtureRequest, reader_fixture: str, qtype: T) -> None:
    reader: gguf.GGUFReader = request.getfixturevalue(reader_fixture)
    tensors = [t for t in reader.tensors if t.tensor_type == qtype]
    assert tensors, f"expected {qtype.name} tensors in the model"
    # The first and the largest tensor of the type: different roles, different row widths.
    largest = max(tensors, key=lambda t: t.n_elements)
    for tensor in {t.name: t for t in (tensors[0], largest)}.values():
        shape = tuple(int(n) for n in reversed(tensor.shape))
        data = tensor.data
        if data.ndim == 2 and data.shape[0] > MAX_ROWS:
            data, shape = data[:MAX_ROWS], (MAX_ROWS, *shape[1:])
        # Copy: the reader's memmap is read-only and torch.from_numpy warns about that.
        raw = np.array(data, copy=True).view(np.uint8)
        ref = gguf_reference(raw, qtype).reshape(shape)
        assert_same_bits(dequantize(torch.from_numpy(raw), qtype, shape), ref)


# --- CUDA --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("sane_scales", (True, False), ids=("sane", "random"))
def test_dequant_cuda_matches_cpu(sane_scales: bool) -> None:
    for qtype in ALL_TYPES:
        rng = np.random.default_rng(2000 + int(qtype))
        raw = random_blocks(qtype, rng, sane_scales=sane_scales)
        if not sane_scales:
            plant_specials(raw, qtype)
        ref = gguf_reference(raw, qtype)
        shape = logical_shape(raw, qtype)
        out = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
        assert out.device.type == "cuda", qtype.name
        assert_same_bits(out, ref)
        assert_same_bits(dequantize(torch.from_numpy(raw), qtype, shape), ref)
