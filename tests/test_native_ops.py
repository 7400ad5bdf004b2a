"""The CPU library's ops (shared/model/native_ops.py over shared/cpu/ops.c) against the torch
references they replace (TorchOps): the norms, the gated activations, and attention with RoPE
and the paged KV write (decode rows, drafts, a prompt chunk; GQA, head sizes, windows, both RoPE
layouts, frequency factors, float32 and float16 caches); a draft row's output is the decode
step's, bit for bit. Each runs on this CPU's build and on one without -march=native (no AVX2,
no F16C: the C fallbacks other CPUs run)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from shared.cpu import native
from shared.kv import KVPool
from shared.model.batch import ForwardBatch, SeqChunk
from shared.model.native_ops import NativeOps
from shared.model.ops_backend import TorchOps
from shared.model.ops_choice import ops_for

if native.load() is None:
    pytest.skip("no CPU library (SKIFF_CPU_NATIVE=0 or no C compiler)", allow_module_level=True)

EPS = 1e-6
BLOCK = 16
N_BLOCKS = 64


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("portable") / "skiff_portable.so"
    lib = native.compile_library(out, native=False)
    assert lib.skiff_simd() == 0
    return lib


@pytest.fixture(params=["native", "portable"])
def ops(request: pytest.FixtureRequest) -> NativeOps:
    """NativeOps over this CPU's build, or over the portable one."""
    ops = NativeOps()
    if request.param == "portable":
        ops.lib = request.getfixturevalue("portable_lib")
    return ops


@contextmanager
def in_c_only() -> Iterator[None]:
    """NativeOps's torch fallbacks (its base class's methods) raise: the C ran."""

    def fallback(*args, **kwargs):
        raise AssertionError("NativeOps fell back to torch")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("rms_norm", "add_rms_norm", "silu_mul", "gelu_mul", "attention"):
            mp.setattr(TorchOps, name, fallback)
        yield


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_ops_for_picks_the_library_on_the_cpu() -> None:
    assert type(ops_for("cpu")) is NativeOps and type(ops_for("cpu", "native")) is NativeOps
    assert type(ops_for("cpu", "torch")) is TorchOps
    with pytest.raises(ValueError, match="unknown ops backend"):
        ops_for("cpu", "fast")


# ---- norms and activations ----


@pytest.mark.parametrize("shape", [(5, 64), (2, 20, 96), (1, 2048)], ids=str)
def test_rms_norm(ops: NativeOps, shape: tuple[int, ...]) -> None:
    x, w = randn(*shape, seed=1, scale=3.0), randn(shape[-1], seed=2)
    want = TorchOps().rms_norm(x, w, EPS)
    with in_c_only():
        got = ops.rms_norm(x, w, EPS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 64), (2, 20, 96)], ids=str)
def test_add_rms_norm(ops: NativeOps, shape: tuple[int, ...]) -> None:
    x, res = randn(*shape, seed=1), randn(*shape, seed=2, scale=10.0)
    w = randn(shape[-1], seed=3)
    want_out, want_sum = TorchOps().add_rms_norm(x, res, w, EPS)
    with in_c_only():
        out, total = ops.add_rms_norm(x, res, w, EPS)
    assert torch.equal(total, want_sum)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)


def test_norms_of_a_strided_weight(ops: NativeOps) -> None:
    x, res, w = randn(5, 64, seed=1), randn(5, 64, seed=2), randn(128, seed=3)[::2]
    torch.testing.assert_close(ops.rms_norm(x, w, EPS), TorchOps().rms_norm(x, w, EPS))
    got, want = ops.add_rms_norm(x, res, w, EPS), TorchOps().add_rms_norm(x, res, w, EPS)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("act", ["silu_mul", "gelu_mul"])
@pytest.mark.parametrize("rows", [3, 70])  # 70 x 1024: over the threads' threshold
@pytest.mark.parametrize("halves", [True, False], ids=["halves", "separate"])
def test_gated_activation(ops: NativeOps, act: str, rows: int, halves: bool) -> None:
    n = 1024
    gate_up = randn(rows, 2 * n, seed=rows, scale=4.0)
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -5.0, -0.0, 0.0, 5.0, 30.0, 100.0])
    gate, up = gate_up[:, :n], gate_up[:, n:]  # views, row stride 2n
    if not halves:
        gate, up = gate.contiguous(), up.contiguous()
    want = getattr(TorchOps(), act)(gate, up)
    with in_c_only():
        got = getattr(ops, act)(gate, up)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gated_activation_of_other_layouts(ops: NativeOps) -> None:
    """Layouts the C does not take (interleaved pairs, different row strides, 3-D) are torch's."""
    y = randn(6, 64, seed=0)
    cases = [(y[:, 0::2], y[:, 1::2]), (y[:, :32], y[:, 32:].contiguous()), (y.view(2, 3, 64),) * 2]
    for gate, up in cases:
        torch.testing.assert_close(ops.silu_mul(gate, up), TorchOps().silu_mul(gate, up))
        torch.testing.assert_close(ops.gelu_mul(gate, up), TorchOps().gelu_mul(gate, up))


# ---- attention ----

# a step's sequences: (keys cached before it, its queries). Decode rows at several lengths
# (16: a block's edge), a 3-row draft step, ROW_WISE_QUERIES (17) rows, and 18 and 40-row
# chunks (the torch path)
SEQS = ((0, 1), (16, 1), (49, 1), (67, 3), (30, 17), (5, 18), (24, 40), (200, 1))
# (head_dim, n_heads, n_kv_heads): 64 and 128 have their own unrolled loops; 256 takes the
# scalar one
HEADS = ((64, 8, 2), (128, 8, 2), (32, 8, 2), (256, 4, 4))
# (sliding window, neox, rope: share of the dims rotated, base, scale, frequency factors)
LAYERS = {
    "plain": (0, False, (1.0, 10000.0, 1.0, False)),
    "window-neox-factors": (20, True, (1.0, 500000.0, 1.0, True)),
    "half-rotated-scaled": (0, True, (0.5, 10000.0, 2.0, False)),
    "window-factors": (20, False, (1.0, 500000.0, 1.0, True)),
}
PLAIN = LAYERS["plain"][2]


def step(seqs: tuple[tuple[int, int], ...], seed: int) -> ForwardBatch:
    """The batch of seqs over blocks scattered in the pool (each sequence's own)."""
    perm = torch.randperm(N_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    chunks, used = [], 0
    for cached, n in seqs:
        blocks = -(-(cached + n) // BLOCK)
        chunks.append(SeqChunk([0] * n, cached, perm[used : used + blocks]))
        used += blocks
    return ForwardBatch.build(chunks, BLOCK, "cpu")


def filled_pool(heads: tuple[int, int, int], dtype: torch.dtype, seed: int) -> KVPool:
    """A pool whose every slot holds a key and value: the cached prefixes."""
    d, _, hk = heads
    kv = KVPool(1, N_BLOCKS, BLOCK, hk, d, dtype, "cpu")
    kv.k[0].copy_(randn(*kv.k[0].shape, seed=seed))
    kv.v[0].copy_(randn(*kv.v[0].shape, seed=seed + 1))
    return kv


def copy_of(kv: KVPool) -> KVPool:
    _, block, hk, d = kv.k[0].shape
    other = KVPool(1, N_BLOCKS, block, hk, d, kv.dtype, "cpu")
    other.k[0].copy_(kv.k[0])
    other.v[0].copy_(kv.v[0])
    return other


def rope_of(d: int, spec: tuple[float, float, float, bool]) -> tuple:
    """attention's rope argument: (rotated dims, base, scale, frequency factors or None)."""
    share, base, scale, factors = spec
    dim = int(d * share)
    freq = 1.0 + torch.arange(dim // 2, dtype=torch.float32) / 4 if factors else None
    return dim, base, scale, freq


@pytest.mark.parametrize("layer", LAYERS.values(), ids=LAYERS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"d{h[0]}")
def test_attention(ops: NativeOps, heads: tuple, dtype: torch.dtype, layer: tuple) -> None:
    d, hq, hk = heads
    window, neox, spec = layer
    batch = step(SEQS, seed=d)
    kv = filled_pool(heads, dtype, seed=d)
    ref = copy_of(kv)
    t = batch.positions.numel()
    q, k, v = randn(t, hq, d, seed=1), randn(t, hk, d, seed=2), randn(t, hk, d, seed=3)
    rope = rope_of(d, spec)
    want, _ = TorchOps().attention(q, k, v, batch, ref, 0, rope, neox, d**-0.5, window)
    with in_c_only():
        got, rounded = ops.attention(q, k, v, batch, kv, 0, rope, neox, d**-0.5, window)
    assert rounded == {}
    f32 = dtype == torch.float32
    # the reference rounds q and the probabilities to a float16 cache's dtype; the C does not
    torch.testing.assert_close(got, want, rtol=1e-5 if f32 else 3e-3, atol=1e-5 if f32 else 3e-3)
    # the rotated keys (RoPE's float32 may differ in an ulp: a float16 key in its last bit)
    # and the values, copied or rounded once as torch does
    rtol = 1e-5 if f32 else 2**-10
    torch.testing.assert_close(kv.k[0].float(), ref.k[0].float(), rtol=rtol, atol=1e-6)
    assert torch.equal(kv.v[0], ref.v[0])


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("heads", [(64, 8, 2), (32, 8, 2), (256, 4, 4)], ids=lambda h: f"d{h[0]}")
def test_a_draft_row_is_the_decode_row(
    ops: NativeOps, heads: tuple, dtype: torch.dtype, window: int
) -> None:
    """Draft rows j of a 3-row step (beside a decode row and a prompt chunk) give what a decode
    step of that row alone gives over the same cache, bit for bit."""
    d, hq, hk = heads
    kv = filled_pool(heads, dtype, seed=5)
    rope = rope_of(d, PLAIN)
    seqs = ((49, 1), (67, 3), (24, 40))
    batch = step(seqs, seed=9)
    t = batch.positions.numel()
    q, k, v = randn(t, hq, d, seed=1), randn(t, hk, d, seed=2), randn(t, hk, d, seed=3)
    out, _ = ops.attention(q, k, v, batch, kv, 0, rope, False, d**-0.5, window)
    table = batch.block_tables[1].tolist()
    for j in range(3):
        row = 1 + j  # the draft step's rows follow the decode row
        alone = ForwardBatch.build([SeqChunk([0], 67 + j, table)], BLOCK, "cpu")
        qkv = (q[row : row + 1], k[row : row + 1], v[row : row + 1])
        once, _ = ops.attention(*qkv, alone, kv, 0, rope, False, d**-0.5, window)
        assert torch.equal(once[0], out[row]), j


@pytest.mark.parametrize("lib", ["native", "portable"])
def test_half_conversions(lib: str, portable_lib: ctypes.CDLL) -> None:
    """The float16 cache's writes round to nearest even as torch does (ties, subnormals,
    overflow) and its reads are exact: every finite float16 value read back through attention
    over one key (the value times 1)."""
    c = native.load() if lib == "native" else portable_lib
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    every = every[every.isfinite()].float()
    mids = (every[:-1] + every[1:]) / 2  # ties (sorted by bits: neighbours of one sign)
    nudge = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(2**16, generator=g) * 10.0 ** (torch.rand(2**16, generator=g) * 14 - 9)
    # the largest half, the ties at the top (to 65504, to inf), overflow, subnormal ties
    extremes = torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -1e6, 2.0**-25, 3 * 2.0**-25])
    x = torch.cat([every, mids, nudge, wide, extremes])
    d = 64
    x = torch.cat([x, torch.zeros(-x.numel() % d)]).view(-1, 1, d)
    t = x.shape[0]
    kc = torch.zeros(t, 1, 1, d, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    slots, q, k, one = torch.arange(t), torch.zeros(t, 1, d), x.clone(), torch.ones(1)
    # rope_dim 0: nothing rotated, k and v written
    c.skiff_rope_kv(
        q.data_ptr(), k.data_ptr(), x.data_ptr(), slots.data_ptr(), t, 1, 1, d, 0, one.data_ptr(),
        1.0, 0, kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), 1,
    )  # fmt: skip
    want = x.view(t, 1, 1, d).half()
    assert torch.equal(vc.view(torch.int16), want.view(torch.int16))
    assert torch.equal(kc.view(torch.int16), want.view(torch.int16))
    # read back: t sequences of one key each, a zero query
    kc.zero_()
    finite = vc.isfinite().view(t, d)
    tables = torch.arange(t, dtype=torch.int32).view(t, 1)
    starts, lens = torch.arange(t + 1, dtype=torch.int32), torch.ones(t, dtype=torch.int32)
    out = torch.empty(t, 1, d)
    c.skiff_attention(
        q.data_ptr(), kc.data_ptr(), vc.data_ptr(), 1, tables.data_ptr(), 1,
        starts.data_ptr(), lens.data_ptr(), t, 1, 1, d, 1, 1.0, 0, out.data_ptr(),
    )  # fmt: skip
    assert torch.equal(out.view(t, d)[finite], vc.float().view(t, d)[finite])
