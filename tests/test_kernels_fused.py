"""The fused Triton kernels (RMSNorm, RoPE + KV write, gated activations) against their torch
references. On CUDA when present, else on the CPU under the Triton interpreter (TRITON_INTERPRET=1
must be set before triton is imported, i.e. in the environment of the pytest run). The `gpu` tests
(real shapes) run only on CUDA: `pytest -m gpu`. FP8 caches: tests/test_kernel_rope_kv_fp8.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "Triton kernels need a CUDA device or TRITON_INTERPRET=1 (CPU interpreter)",
        allow_module_level=True,
    )

from shared.kernels.activation import gelu_mul, gelu_mul_separate, silu_mul, silu_mul_separate
from shared.kernels.norm import add_rms_norm, rms_norm
from shared.kernels.rope_kv import rope_and_write_kv
from shared.ops import activation as act_ref
from shared.ops.fused_norm import add_rms_norm_ref
from shared.ops.norm import rms_norm as rms_norm_ref
from shared.ops.paged_attention_fp8 import FP8 as FP8_DTYPE
from shared.ops.rope_kv import rope_and_write_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (rtol, atol). bf16 allows 2 ulp: the interpreter rounds fp32 -> bf16 toward zero.
TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
# The kernel's inv_freq (exp2 in fp32) and the reference's (pow, reciprocal) differ by ~1 ulp, so
# angles differ by up to ~theta * 1.2e-7 (measured 1.4e-7 on the interpreter); allow 4e-7.
ANGLE_RTOL = 4e-7
EPS = 1e-6


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [576, 640, 4096])
def test_rms_norm_rows(n: int, dtype: torch.dtype) -> None:
    # rows of a wider buffer: a row stride other than n
    x = _randn(5, n + 64, dtype=dtype)[:, :n] * 3
    w = _randn(n, seed=1)
    torch.testing.assert_close(
        rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), rtol=TOL[dtype][0], atol=TOL[dtype][1]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [576, 640, 4096])
def test_add_rms_norm(n: int, dtype: torch.dtype) -> None:
    x = _randn(5, n, dtype=dtype)
    residual = _randn(5, n, dtype=dtype, seed=1) * 4
    w = _randn(n, dtype=dtype, seed=2)
    normed, new_residual = add_rms_norm(x, residual, w, EPS)
    want_normed, want_residual = add_rms_norm_ref(x, residual, w, EPS)
    rtol, atol = TOL[dtype]
    if DEVICE == "cuda" or dtype != torch.bfloat16:  # one fp32 add, one rounding: bit-exact
        assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(new_residual, want_residual, rtol=rtol, atol=atol)
    torch.testing.assert_close(normed, want_normed, rtol=rtol, atol=atol)
    assert not torch.equal(x, new_residual)  # inputs untouched, outputs new


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_qk_norm_over_heads(dtype: torch.dtype) -> None:
    n_tok, n_heads, n_kv, d = 6, 4, 2, 128
    qkv = _randn(n_tok, (n_heads + 2 * n_kv) * d, dtype=dtype)
    q = qkv[:, : n_heads * d].view(n_tok, n_heads, d)  # strided view, as a fused QKV gives
    k = qkv[:, n_heads * d : (n_heads + n_kv) * d].view(n_tok, n_kv, d)
    wq, wk = _randn(d, seed=1), _randn(d, seed=2)
    rtol, atol = TOL[dtype]
    for x, w in ((q, wq), (k, wk)):
        out = rms_norm(x, w, EPS)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), rtol=rtol, atol=atol)


def test_norm_rejects_bad_inputs() -> None:
    x = _randn(3, 64)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        rms_norm(x, _randn(32), EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x.double(), _randn(64), EPS)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        rms_norm(_randn(64, 3).t(), _randn(64), EPS)
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm(x, x.half(), _randn(64), EPS)
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        add_rms_norm(x[None], x[None], _randn(64), EPS)
    assert rms_norm(_randn(0, 64), _randn(64), EPS).shape == (0, 64)


# ---------------------------------------------------------------- RoPE + paged KV write


def _split_qkv(n_tok: int, n_heads: int, n_kv: int, d: int, dtype: torch.dtype, seed: int):
    """q, k, v as strided views of one fused projection output."""
    qkv = _randn(n_tok, (n_heads + 2 * n_kv) * d, dtype=dtype, seed=seed) * 2
    q = qkv[:, : n_heads * d].view(n_tok, n_heads, d)
    k = qkv[:, n_heads * d : (n_heads + n_kv) * d].view(n_tok, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d :].view(n_tok, n_kv, d)
    return q, k, v


def _slots(n_tok: int, num_blocks: int, block_size: int, start: int, seed: int) -> torch.Tensor:
    """Consecutive tokens from offset `start` of a shuffled block table; the last one padding."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g)
    i = torch.arange(n_tok) + start
    slots = blocks[i // block_size] * block_size + i % block_size
    slots[-1] = -1
    return slots.to(DEVICE)


def _assert_rope_close(got, want, x, theta_max, dtype, what):
    """|got - want| <= atol + rtol |want| + angle error * magnitude, per token row."""
    rtol, atol = TOL[dtype]
    got, want, x = got.float(), want.float(), x.float()
    mag = 2 * x.abs().flatten(1).amax(dim=1)  # bounds the norm of any rotated pair
    bound = atol + rtol * want.abs() + (ANGLE_RTOL * theta_max * mag).view(-1, 1, 1)
    excess = (got - want).abs() - bound
    assert excess.max() <= 0, (
        f"{what}: exceeds tolerance by {excess.max():.3g} at {excess.argmax()}"
    )


def _check_cache(got, want, before, slots, k_in, theta_max, dtype, what):
    """Whole cache: rows not in slots bit-identical to before, written rows close to want."""
    kvh, d = got.shape[2:]
    got, want, before = (c.reshape(-1, kvh, d) for c in (got, want, before))
    written = torch.zeros(got.shape[0], dtype=torch.bool, device=got.device)
    live = slots >= 0
    written[slots[live]] = True
    assert torch.equal(got[~written].view(torch.uint8), before[~written].view(torch.uint8)), what
    _assert_rope_close(
        got[slots[live]], want[slots[live]], k_in[live], theta_max[live], dtype, what
    )


ROPE_CASES = {
    # name: (head_dim, rope_dim, scale, freq factors, max position)
    "full": (64, 64, 1.0, False, 64),
    "partial_ff_scale": (80, 48, 4.0, True, 4096),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_and_write_kv(case: str, neox: bool, dtype: torch.dtype) -> None:
    d, rope_dim, scale, use_ff, max_pos = ROPE_CASES[case]
    n_tok, n_heads, n_kv, num_blocks, block_size = 9, 4, 2, 6, 4
    q, k, v = _split_qkv(n_tok, n_heads, n_kv, d, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    positions = torch.randint(0, max_pos, (n_tok,), generator=g).to(DEVICE)
    ff = (torch.rand(rope_dim // 2, generator=g) * 4 + 0.5).to(DEVICE) if use_ff else None
    slots = _slots(n_tok, num_blocks, block_size, start=2, seed=5)
    before = [_randn(num_blocks, block_size, n_kv, d, dtype=dtype, seed=s) for s in (6, 7)]
    k_cache, v_cache = (c.clone() for c in before)
    k_want, v_want = (c.clone() for c in before)

    q_out = rope_and_write_kv(
        q, k, v, positions, k_cache, v_cache, slots, rope_dim, 1e4, neox, scale, ff
    )
    q_want = rope_and_write_kv_ref(
        q, k, v, positions, k_want, v_want, slots, rope_dim, 1e4, neox, scale, ff
    )

    theta_max = positions.double() / scale / (ff.min().item() if ff is not None else 1.0)
    assert q_out.shape == q.shape and q_out.dtype == dtype
    _assert_rope_close(q_out, q_want, q, theta_max, dtype, "q")
    _check_cache(k_cache, k_want, before[0], slots, k, theta_max, dtype, "k_cache")
    _check_cache(v_cache, v_want, before[1], slots, v, theta_max * 0, dtype, "v_cache")
    if rope_dim < d:  # features past rope_dim pass through unchanged
        assert torch.equal(q_out[..., rope_dim:], q[..., rope_dim:])


def test_rope_and_write_kv_casts_to_cache_dtype() -> None:
    """fp32 activations into a bf16 cache: rotated in fp32, rounded once by the write."""
    n_tok, n_heads, n_kv, d = 5, 2, 1, 64
    q, k, v = _split_qkv(n_tok, n_heads, n_kv, d, torch.float32, seed=8)
    positions = torch.arange(n_tok, device=DEVICE) + 30
    slots = _slots(n_tok, 4, 4, start=0, seed=9)
    before = [_randn(4, 4, n_kv, d, dtype=torch.bfloat16, seed=s) for s in (1, 2)]
    caches, wants = [c.clone() for c in before], [c.clone() for c in before]
    q_out = rope_and_write_kv(q, k, v, positions, *caches, slots, d, 1e6, True)
    q_want = rope_and_write_kv_ref(q, k, v, positions, *wants, slots, d, 1e6, True)
    theta = positions.double()
    _assert_rope_close(q_out, q_want, q, theta, torch.float32, "q")
    _check_cache(caches[0], wants[0], before[0], slots, k, theta, torch.bfloat16, "k_cache")
    _check_cache(caches[1], wants[1], before[1], slots, v, theta * 0, torch.bfloat16, "v_cache")


def test_rope_rounds_16_bit_results_to_nearest() -> None:
    """bf16 / fp16 q and cache rows are the float32 rotation rounded to nearest even, as the GPU
    converts (the interpreter's own float32 -> bf16 cast truncates: the kernel rounds by hand)."""
    n_tok, n_heads, n_kv, d = 7, 4, 2, 64
    pos = torch.arange(n_tok, device=DEVICE) * 37 + 5
    slots = _slots(n_tok, 4, 4, start=0, seed=12)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _split_qkv(n_tok, n_heads, n_kv, d, dtype, seed=11)
        narrow = [torch.zeros(4, 4, n_kv, d, dtype=dtype, device=DEVICE) for _ in range(2)]
        wide = [torch.zeros(4, 4, n_kv, d, device=DEVICE) for _ in range(2)]
        q_narrow = rope_and_write_kv(q, k, v, pos, *narrow, slots, d, 1e4, False)
        q_wide = rope_and_write_kv(
            q.float(), k.float(), v.float(), pos, *wide, slots, d, 1e4, False
        )
        assert torch.equal(q_narrow, q_wide.to(dtype))
        for got, want in zip(narrow, wide, strict=True):
            assert torch.equal(got, want.to(dtype))


def test_rope_rejects_bad_inputs() -> None:
    q, k, v = _split_qkv(3, 2, 1, 64, torch.float32, seed=1)
    pos = torch.arange(3, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    kc, vc = _randn(2, 4, 1, 64), _randn(2, 4, 1, 64)
    with pytest.raises(ValueError, match="rope_dim"):
        rope_and_write_kv(q, k, v, pos, kc, vc, slots, 63, 1e4, True)
    with pytest.raises(ValueError, match="positions"):
        rope_and_write_kv(q, k, v, pos.int(), kc, vc, slots, 64, 1e4, True)
    with pytest.raises(ValueError, match="k_cache"):
        rope_and_write_kv(q, k, v, pos, kc[..., :32], vc, slots, 64, 1e4, True)
    with pytest.raises(ValueError, match="share"):
        rope_and_write_kv(q, k.half(), v, pos, kc, vc, slots, 64, 1e4, True)
    with pytest.raises(ValueError, match="freq_factors"):
        rope_and_write_kv(q, k, v, pos, kc, vc, slots, 64, 1e4, True, 1.0, _randn(31))
    with pytest.raises(ValueError, match="scale caches"):
        rope_and_write_kv(
            q, k, v, pos, kc, vc, slots, 64, 1e4, True, 1.0, None, _randn(2, 4, 1), _randn(2, 4, 1)
        )
    with pytest.raises(ValueError, match="needs k_scale_cache"):
        rope_and_write_kv(q, k, v, pos, kc.to(FP8_DTYPE), vc.to(FP8_DTYPE), slots, 64, 1e4, True)


# ---------------------------------------------------------------- gated activations


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy exp under the interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("f", [64, 1000, 2816])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_gated_activation(gelu: bool, f: int, dtype: torch.dtype) -> None:
    gate_up = _randn(3, 2 * f, dtype=dtype) * 4  # reaches the saturated tails
    gate_up[0, 0], gate_up[0, 1] = -100.0, 100.0
    gate, up = gate_up[:, :f], gate_up[:, f:]
    fused, separate = (gelu_mul, gelu_mul_separate) if gelu else (silu_mul, silu_mul_separate)
    ref = (act_ref.gelu_mul if gelu else act_ref.silu_mul)(gate.float(), up.float()).to(dtype)
    rtol, atol = TOL[dtype]
    out = fused(gate_up)
    assert out.shape == (3, f) and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(separate(gate.contiguous(), up), ref, rtol=rtol, atol=atol)


def test_activation_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="even"):
        silu_mul(_randn(2, 7))
    with pytest.raises(ValueError, match="2-D"):
        gelu_mul(_randn(2, 2, 8))
    with pytest.raises(ValueError, match="match"):
        silu_mul_separate(_randn(2, 8), _randn(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        gelu_mul_separate(_randn(8, 2).t(), _randn(2, 8))


# ---------------------------------------------------------------- real shapes on the GPU


REAL_SHAPES = (4096, 4096, 32, 8, 128, 14336)  # tokens, hidden, heads, kv heads, head_dim, ffn


def _real_shape_case(kernel: str, shapes: tuple[int, ...] = REAL_SHAPES) -> None:
    n_tok, hidden, n_heads, n_kv, d, ffn = shapes
    bf16 = torch.bfloat16
    rtol, atol = TOL[bf16]
    if kernel == "rms_norm":
        x, w = _randn(n_tok, hidden, dtype=bf16), _randn(hidden, seed=1)
        torch.testing.assert_close(
            rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), rtol=rtol, atol=atol
        )
    elif kernel == "add_rms_norm":
        x, r, w = (
            _randn(n_tok, hidden, dtype=bf16),
            _randn(n_tok, hidden, dtype=bf16, seed=1),
            _randn(hidden, seed=2),
        )
        for got, want in zip(
            add_rms_norm(x, r, w, EPS), add_rms_norm_ref(x, r, w, EPS), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    elif kernel == "qk_norm":
        q, k, _ = _split_qkv(n_tok, n_heads, n_kv, d, bf16, seed=3)
        w = _randn(d, seed=4)
        for x in (q, k):
            torch.testing.assert_close(
                rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), rtol=rtol, atol=atol
            )
    elif kernel.startswith("rope"):
        neox = kernel == "rope_neox"
        q, k, v = _split_qkv(n_tok, n_heads, n_kv, d, bf16, seed=5)
        positions = torch.randperm(n_tok, device=DEVICE) + 100
        num_blocks, block_size = 2 * n_tok // 16, 16
        slots = _slots(n_tok, num_blocks, block_size, start=5, seed=6)
        before = [_randn(num_blocks, block_size, n_kv, d, dtype=bf16, seed=s) for s in (7, 8)]
        got, want = [c.clone() for c in before], [c.clone() for c in before]
        q_out = rope_and_write_kv(q, k, v, positions, *got, slots, d, 5e5, neox)
        q_want = rope_and_write_kv_ref(q, k, v, positions, *want, slots, d, 5e5, neox)
        theta = positions.double()
        _assert_rope_close(q_out, q_want, q, theta, bf16, "q")
        _check_cache(got[0], want[0], before[0], slots, k, theta, bf16, "k_cache")
        _check_cache(got[1], want[1], before[1], slots, v, theta * 0, bf16, "v_cache")
    else:
        gate_up = _randn(n_tok, 2 * ffn, dtype=bf16) * 3
        fn, ref = (gelu_mul, act_ref.gelu_mul) if kernel == "gelu" else (silu_mul, act_ref.silu_mul)
        want = ref(gate_up[:, :ffn].float(), gate_up[:, ffn:].float()).to(bf16)
        torch.testing.assert_close(fn(gate_up), want, rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kernel", ["rms_norm", "add_rms_norm", "qk_norm", "rope_norm", "rope_neox", "silu", "gelu"]
)
def test_real_shapes_bf16(kernel: str) -> None:
    if DEVICE != "cuda":
        pytest.skip("real shapes need a CUDA device (far too slow under the interpreter)")
    _real_shape_case(kernel)
