"""RoPE and the KV-cache write in the batch-1 Q/K/V GEMV's epilogue
(shared/kernels/qmatmul/qkv_rope.py):

- the rows GEMV with the epilogue gives the q, cache keys and cache values of the rows GEMV
  followed by ``rope_and_write_kv`` (bit for bit under the interpreter; within a bfloat16 unit
  of the last place on a GPU, where the compiler may contract the rotation differently), with
  frequency factors, a partial rope_dim, split K, a negative slot (nothing written) and
  bfloat16 and float32 caches; the split-K tickets are back at zero;
- the paired launch (Q4_K_M's Q4_K q/k beside a Q6_K v) likewise;
- ``SplitLinear.forward_rope`` runs it over interleaved parts and refuses what it cannot take
  (a bias, rows that are not q/k/v, more than one token, an FP8 cache, q in a type measured
  slower with it), leaving the caches alone.

Under TRITON_INTERPRET=1 the integer emulation runs; on a GPU the PTX."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.device import interpreted
from shared.kernels.qmatmul.int8_activations import prepare_int8
from shared.kernels.qmatmul.packed import pack
from shared.kernels.qmatmul.packed_int8_pair import gemv_int8_pair_kernel, rows_gemv_pair
from shared.kernels.qmatmul.packed_matmul import packed_matmul
from shared.kernels.qmatmul.packed_rows import interleave
from shared.kernels.qmatmul.qkv_rope import QKVRope
from shared.kernels.rope_kv import rope_and_write_kv
from shared.model.linear import QuantLinear, SplitLinear
from tests.test_kernel_packed_matmul import random_raw

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
N_HEADS, N_KV, HEAD_DIM, K = 4, 2, 32, 512
Q_DIM, KV_DIM = N_HEADS * HEAD_DIM, N_KV * HEAD_DIM


def _weight(qtype: T, n: int, seed: int):
    return interleave(pack(random_raw(qtype, n, K, seed=seed).to(DEVICE), qtype, (n, K)))


def _target(dtype: torch.dtype, slot: int, rope_dim: int, factors: bool) -> QKVRope:
    shape = (4, 16, N_KV, HEAD_DIM)  # 64 slots
    ff = torch.linspace(1.0, 4.0, rope_dim // 2, device=DEVICE) if factors else None
    return QKVRope(
        torch.tensor([37], device=DEVICE), torch.tensor([slot], device=DEVICE),
        torch.zeros(shape, dtype=dtype, device=DEVICE),
        torch.zeros(shape, dtype=dtype, device=DEVICE), N_HEADS, rope_dim, 5e5, 2.0, ff,
    )  # fmt: skip


def _apart(out: torch.Tensor, t: QKVRope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k cache, v cache) of the two launches: the GEMV's rows, then rope_and_write_kv."""
    kc, vc = torch.zeros_like(t.k_cache), torch.zeros_like(t.v_cache)
    q, k, v = torch.split(out, [Q_DIM, KV_DIM, KV_DIM], dim=-1)
    q = rope_and_write_kv(
        q.view(1, N_HEADS, HEAD_DIM), k.view(1, N_KV, HEAD_DIM), v.view(1, N_KV, HEAD_DIM),
        t.positions, kc, vc, t.slot_mapping, t.rope_dim, t.base, False, t.scale, t.freq_factors,
    )  # fmt: skip
    return q.reshape(1, Q_DIM), kc, vc


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:  # one bfloat16 unit of the last place at most (float32: 2^-16 relative)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("split", "dtype", "rope_dim", "factors"),
    [(1, torch.bfloat16, 32, True), (2, torch.bfloat16, 16, False), (2, torch.float32, 32, True)],
)
def test_the_epilogue_equals_the_gemv_then_rope_and_write_kv(
    qtype: T, split: int, dtype: torch.dtype, rope_dim: int, factors: bool
) -> None:
    pw = _weight(qtype, Q_DIM + 2 * KV_DIM, seed=split)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    cfg = {"ROWS": 1, "num_warps": 2, "SPLIT_K": split}
    t = _target(dtype, 21, rope_dim, factors)
    want_q, want_k, want_v = _apart(packed_matmul(x, pw, config=cfg), t)
    for _ in range(2):  # the tickets are zero again after a launch
        out = packed_matmul(x, pw, config=cfg, rope=(t, 0))
        assert not pw.tickets.any()
    _same(out[:, :Q_DIM], want_q)
    _same(t.k_cache, want_k)
    _same(t.v_cache, want_v)
    assert t.k_cache[1, 5].any() and t.v_cache[1, 5].any()  # slot 21: block 1, offset 5
    assert not t.k_cache[0].any() and not t.v_cache[2:].any()  # nothing else written


def test_a_negative_slot_writes_nothing() -> None:
    pw = _weight(T.Q4_K, Q_DIM + 2 * KV_DIM, seed=1)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    t = _target(torch.bfloat16, -1, HEAD_DIM, False)
    out = packed_matmul(x, pw, rope=(t, 0))
    want_q, _, _ = _apart(packed_matmul(x, pw), t)
    _same(out[:, :Q_DIM], want_q)
    assert not t.k_cache.any() and not t.v_cache.any()


@pytest.mark.parametrize("split", [1, 2])
def test_the_paired_launch_takes_it_too(split: int) -> None:
    """Q4_K q/k (rows 0 .. Q_DIM + KV_DIM) beside a Q6_K v (the rest), one launch."""
    a, b = _weight(T.Q4_K, Q_DIM + KV_DIM, seed=2), _weight(T.Q6_K, KV_DIM, seed=3)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    int8_a, int8_b = prepare_int8(x[0], a), prepare_int8(x[0], b)
    cfg = {"ROWS": 1, "num_warps": 2}
    interp = interpreted(gemv_int8_pair_kernel)
    t = _target(torch.bfloat16, 40, HEAD_DIM, True)
    plain = rows_gemv_pair(x, a, b, int8_a, int8_b, cfg, split, interp)
    want_q, want_k, want_v = _apart(torch.cat(plain, dim=1), t)
    out_a, _ = rows_gemv_pair(x, a, b, int8_a, int8_b, cfg, split, interp, (t, 0))
    _same(out_a[:, :Q_DIM], want_q)
    _same(t.k_cache, want_k)
    _same(t.v_cache, want_v)
    assert t.v_cache[2, 8].any() and not a.tickets.any() and not b.tickets.any()


def _split_linear(bias: bool = False, q_type: T = T.Q4_K) -> SplitLinear:
    def part(qtype: T, n: int, seed: int) -> QuantLinear:
        raw = random_raw(qtype, n, K, seed=seed)
        lin = QuantLinear(raw, qtype, (n, K), torch.bfloat16, use_kernels=True)
        lin.packed = interleave(pack(raw.to(DEVICE), qtype, (n, K)))
        if bias:
            lin.bias = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
        return lin

    parts = [part(q_type, Q_DIM + KV_DIM, 4), part(T.Q6_K, KV_DIM, 5)]
    return SplitLinear(parts, [Q_DIM, KV_DIM, KV_DIM])


def test_split_linear_forward_rope_equals_forward_then_rope() -> None:
    layer = _split_linear()
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    t = _target(torch.bfloat16, 9, HEAD_DIM, True)
    want_q, want_k, want_v = _apart(torch.cat(layer(x), dim=1), t)
    q = layer.forward_rope(x, None, t)  # nothing rounded ahead: one launch a part
    assert q is not None and q.shape == (1, Q_DIM)
    _same(q, want_q)
    _same(t.k_cache, want_k)
    _same(t.v_cache, want_v)


def test_split_linear_forward_rope_refuses_what_it_cannot_take() -> None:
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    t = _target(torch.bfloat16, 9, HEAD_DIM, False)
    assert _split_linear().forward_rope(x, None, t) is None  # two tokens
    assert _split_linear(bias=True).forward_rope(x[:1], None, t) is None
    # q in Q6_K: measured slower with the epilogue on the H200 (linear.QKV_ROPE_SKIP_TYPES)
    assert _split_linear(q_type=T.Q6_K).forward_rope(x[:1], None, t) is None
    other = QKVRope(t.positions, t.slot_mapping, t.k_cache, t.v_cache, N_HEADS - 1, 32, 1e4)
    assert _split_linear().forward_rope(x[:1], None, other) is None  # not q/k/v rows
    fp8 = torch.zeros(t.k_cache.shape, device=DEVICE).to(torch.float8_e4m3fn)
    assert QKVRope(t.positions, t.slot_mapping, fp8, fp8, N_HEADS, 32, 1e4).refusal(torch.bfloat16)
    assert "rope_dim" in QKVRope(t.positions, t.slot_mapping, t.k_cache, t.v_cache, N_HEADS, 33,
                                 1e4).refusal(torch.bfloat16)  # fmt: skip
    assert not t.k_cache.any() and not t.v_cache.any()
