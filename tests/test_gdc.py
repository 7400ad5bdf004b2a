"""Programmatic dependent launch (shared/kernels/gdc.py).

On the CPU: when it is on (a GPU of sm_90 or later, not the interpreter).
On a GPU (``-m gpu``): a decode layer's chain of early-launched kernels (residual add + RMSNorm,
activation rounding, the rows GEMV with split-K and the gated epilogue, rope + KV write, paged
attention with split-K and its combine), captured in a CUDA graph and replayed with new inputs,
gives the same bits as the same kernels launched one after the other without PDL (as below
sm_90: every kernel module's ``pdl`` answering False). A kernel that read its input before the
previous one finished would differ on some replay.
"""

from __future__ import annotations

import sys

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels import gdc
from shared.kernels.gdc import launch_kw, pdl


def test_off_on_the_cpu() -> None:
    assert not pdl(torch.device("cpu"), object())
    assert launch_kw(False) == {} and launch_kw(True) == {"launch_pdl": True}


def test_off_for_interpreted_kernels() -> None:
    from shared.kernels import norm
    from shared.kernels.device import interpreted

    if interpreted(norm._rms_norm_kernel):  # TRITON_INTERPRET=1 (CI)
        assert not pdl(torch.device("cuda"), norm._rms_norm_kernel)


def _layer(x, res, w_norm, pw_up, pw_down, kv, meta):
    """One decode layer of early-launched kernels, as the engine runs them."""
    from shared.kernels.norm import add_rms_norm
    from shared.kernels.paged_attention import paged_attention
    from shared.kernels.qmatmul.packed_matmul import packed_matmul
    from shared.kernels.rope_kv import rope_and_write_kv

    h, res2 = add_rms_norm(x, res, w_norm, 1e-5)
    qkv = packed_matmul(h, pw_up, act=0)  # [1, 4096]: 16 q heads, 8 k, 8 v
    heads = qkv.view(1, 32, 128)
    q, k, v = heads[:, :16], heads[:, 16:24], heads[:, 24:]
    pos, slots, tables, starts, lens = meta
    q = rope_and_write_kv(q, k, v, pos, kv[0], kv[1], slots, 128, 500000.0, False)
    o = paged_attention(q, kv[0], kv[1], tables, starts, lens, 0.088, max_query_len=1,
                        max_seq_len=4096, num_splits=8)  # fmt: skip
    h2, res3 = add_rms_norm(o.reshape(1, 2048), res2, w_norm[:2048].contiguous(), 1e-5)
    return packed_matmul(h2, pw_down, act=1), res3


@pytest.mark.gpu
def test_graph_of_early_launches_matches_plain_launches(monkeypatch) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA device of sm_90 or later")
    from shared.kernels.qmatmul.packed import pack
    from shared.kernels.qmatmul.packed_rows import interleave
    from tests.test_kernel_packed_matmul import random_raw

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    pw_up = interleave(pack(random_raw(T.Q4_K, 4096, 2048, seed=1).to(dev), T.Q4_K, (4096, 2048)))
    pw_down = interleave(pack(random_raw(T.Q6_K, 8192, 2048, seed=2).to(dev), T.Q6_K, (8192, 2048)))
    w_norm = torch.rand(2048, generator=g).to(dev, torch.bfloat16) + 0.5
    blocks, bs, ctx = 256, 16, 3000
    kv = [torch.randn(blocks, bs, 8, 128, generator=g).to(dev, torch.bfloat16) for _ in range(2)]
    tables = torch.randperm(blocks, generator=g)[None].to(dev, torch.int32)
    pos = torch.tensor([ctx - 1], device=dev)
    slot = int(tables[0, (ctx - 1) // bs]) * bs + (ctx - 1) % bs
    slots = torch.tensor([slot], device=dev)
    starts = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
    meta = (pos, slots, tables, starts, lens)
    x = torch.zeros(1, 2048, device=dev, dtype=torch.bfloat16)
    res = torch.zeros_like(x)

    def inputs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gi = torch.Generator(device="cpu").manual_seed(100 + i)
        return tuple(torch.randn(1, 2048, generator=gi).to(dev, torch.bfloat16) for _ in "xr")

    want = []
    with monkeypatch.context() as patch:
        _layer(x, res, w_norm, pw_up, pw_down, kv, meta)  # imports the kernels' modules
        for name, mod in list(sys.modules.items()):  # each kernel module's own gdc.pdl
            ours = name.startswith("shared.kernels.") and mod is not gdc
            if ours and getattr(mod, "pdl", None) is gdc.pdl:
                patch.setattr(mod, "pdl", lambda device, kernel: False)
        for i in range(20):
            x.copy_(inputs(i)[0]), res.copy_(inputs(i)[1])
            want.append([t.clone() for t in _layer(x, res, w_norm, pw_up, pw_down, kv, meta)])
            assert all(torch.isfinite(t).all() for t in want[-1])
    _layer(x, res, w_norm, pw_up, pw_down, kv, meta)  # compiles the early-launched kernels
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = _layer(x, res, w_norm, pw_up, pw_down, kv, meta)
    for i in range(20):
        x.copy_(inputs(i)[0]), res.copy_(inputs(i)[1])
        graph.replay()
        torch.cuda.synchronize()
        for got, exp in zip(out, want[i], strict=True):
            assert torch.equal(got, exp), f"replay {i}"
