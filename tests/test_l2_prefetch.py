"""L2 prefetch tables (shared.kernels.l2_prefetch, shared.model.l2_plan): the pieces cover
exactly the bytes asked for, aligned and bounded; a layer's plan takes the output projection
whole and then the gate/up's leading row tiles within the budget; the RoPE launch that carries a
table compiles for sm_90 with the bulk prefetch in it; and on a GPU its results do not change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shared.kernels.l2_prefetch import PIECE, table
from shared.model import l2_plan

ROOT = Path(__file__).resolve().parent.parent


def _pieces(tab: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(tab[0].tolist(), tab[1].tolist(), strict=True))


def test_table_covers_the_leading_bytes_in_aligned_pieces() -> None:
    a = torch.empty(3 * PIECE + 100, dtype=torch.uint8)
    b = torch.empty(1000, dtype=torch.int32)  # 4,000 bytes
    tab = table([(a, 2 * PIECE + 37), (b, 4000)])
    pieces = _pieces(tab)
    assert tab.dtype == torch.int64 and tab.shape == (2, 4)
    # a: two whole pieces, then 37 bytes, whose 5 past the last 16 are left out; b: one piece
    assert pieces == [
        (a.data_ptr(), PIECE),
        (a.data_ptr() + PIECE, PIECE),
        (a.data_ptr() + 2 * PIECE, 32),
        (b.data_ptr(), 4000),
    ]
    assert all(addr % 16 == 0 and 0 < size <= PIECE and size % 16 == 0 for addr, size in pieces)


def test_table_refuses_what_it_cannot_ask_for() -> None:
    t = torch.empty(4096, dtype=torch.uint8)
    assert table([]) is None and table([(t, 0)]) is None and table([(t, 15)]) is None
    with pytest.raises(ValueError, match="4097 bytes of a 4096-byte tensor"):
        table([(t, 4097)])
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        table([(t[1:], 64)])
    with pytest.raises(ValueError, match="contiguous"):
        table([(t.view(64, 64).t(), 64)])


def _linear(*sizes: int) -> SimpleNamespace:
    """A stand-in QuantLinear whose packed planes have these byte sizes (q, sc, d)."""
    q, sc, d = (torch.empty(n, dtype=torch.uint8) for n in sizes)
    return SimpleNamespace(packed=SimpleNamespace(q=q, hi=None, sc=sc, mn=None, d=d, dmin=None))


def _bytes_by_tensor(tab: torch.Tensor, *lins: SimpleNamespace) -> dict[int, int]:
    """Bytes asked for of each plane of lins (by its address); every piece lies in one."""
    planes = [t for lin in lins for t in vars(lin.packed).values() if t is not None]
    out = {t.data_ptr(): 0 for t in planes}
    for addr, size in _pieces(tab):
        (t,) = [t for t in planes if t.data_ptr() <= addr < t.data_ptr() + t.numel()]
        assert addr + size <= t.data_ptr() + t.numel()
        out[t.data_ptr()] += size
    return out


def test_plan_takes_whole_weights_then_a_share_of_the_next() -> None:
    wo = _linear(64 * 1024, 8 * 1024, 1024)  # 74,752 bytes
    up = _linear(256 * 1024, 32 * 1024, 4096)  # 299,008 bytes
    tab = l2_plan.plan([wo, up], wo_bytes := 74_752 + 299_008 // 2)
    got = _bytes_by_tensor(tab, wo, up)
    assert got[wo.packed.q.data_ptr()] == 64 * 1024
    assert got[wo.packed.sc.data_ptr()] == 8 * 1024 and got[wo.packed.d.data_ptr()] == 1024
    # half of each gate/up plane: the same leading row tiles of every plane
    assert got[up.packed.q.data_ptr()] == 128 * 1024
    assert got[up.packed.sc.data_ptr()] == 16 * 1024 and got[up.packed.d.data_ptr()] == 2048
    assert sum(got.values()) == wo_bytes
    # a budget under the first weight: a share of it alone; none: no table
    part = _bytes_by_tensor(l2_plan.plan([wo, up], 74_752 // 4), wo, up)
    assert [part[t.data_ptr()] for t in (wo.packed.q, wo.packed.sc, wo.packed.d)] == [
        16384, 2048, 256]  # fmt: skip
    assert sum(part.values()) == 74_752 // 4
    assert l2_plan.plan([wo, up], 0) is None


def test_budget_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKIFF_L2_PREFETCH_MB", raising=False)
    assert l2_plan.budget_bytes() == 0
    monkeypatch.setenv("SKIFF_L2_PREFETCH_MB", "1.5")
    assert l2_plan.budget_bytes() == 3 << 19


def test_attach_leaves_cpu_weights_without_a_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIFF_L2_PREFETCH_MB", "32")
    attn = SimpleNamespace(wo=_linear(4096, 512, 64), l2_prefetch=None)
    mlp = SimpleNamespace(gated=SimpleNamespace(fused=_linear(8192, 1024, 128)))
    l2_plan.attach(attn, mlp)
    assert attn.l2_prefetch is None  # host memory: nothing a GPU could prefetch


def test_rope_launch_with_a_table_compiles_the_bulk_prefetch_for_sm90() -> None:
    code = (
        "from tools.compile_launches import compile_rope_kv\n"
        "from tools.kernel_sass import _cuobjdump\n"
        "for on in (False, True):\n"
        "    sass = _cuobjdump(compile_rope_kv('bf16', 90, on).asm['cubin'], '-sass')\n"
        "    print(on, sass.count('UBLKPF.L2'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real compiles
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "0", "True", "1"], done.stdout


@pytest.mark.gpu
def test_rope_results_do_not_depend_on_the_prefetch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from shared.kernels.rope_kv import rope_and_write_kv

    g = torch.Generator(device="cuda").manual_seed(0)
    t, n_kv, hd = 3, 8, 128
    qkv = torch.randn(t, 48 * hd, device="cuda", generator=g).bfloat16()
    q, k, v = qkv[:, : 32 * hd], qkv[:, 32 * hd : 40 * hd], qkv[:, 40 * hd :]
    q, k, v = q.view(t, 32, hd), k.view(t, n_kv, hd), v.view(t, n_kv, hd)
    weight = torch.randint(0, 255, (9 << 20,), dtype=torch.uint8, device="cuda")
    outs = []
    for tab in (None, table([(weight, weight.numel())])):
        cache = torch.zeros(16, 16, n_kv, hd, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(cache)
        pos = torch.tensor([5, 17, 200], device="cuda")
        q_out = rope_and_write_kv(q, k, v, pos, cache, vc, pos, hd, 5e5, False, l2_prefetch=tab)
        outs.append((q_out, cache, vc))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
