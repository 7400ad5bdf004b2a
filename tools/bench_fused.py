"""Times the fused Triton kernels against their torch references on CUDA and prints GB/s.

    python -m tools.bench_fused [--tokens 1 64 4096] [--kv-dtype bf16|fp8]

GB/s counts the bytes each kernel must move (inputs read once, outputs written once), the same
count for the reference, so the two columns compare directly.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import triton.testing

from shared.kernels.activation import gelu_mul, silu_mul
from shared.kernels.norm import add_rms_norm, rms_norm
from shared.kernels.rope_kv import rope_and_write_kv
from shared.ops import activation as act_ref
from shared.ops.fused_norm import add_rms_norm_ref
from shared.ops.norm import rms_norm as rms_norm_ref
from shared.ops.rope_kv import rope_and_write_kv_ref

EPS = 1e-6
DEVICE = "cuda"


def _gbps(n_bytes: int, ms: float) -> float:
    return n_bytes / ms / 1e6


def _row(name: str, n_tok: int, n_bytes: int, kernel: Callable, ref: Callable) -> None:
    ms_k = triton.testing.do_bench(kernel)
    ms_r = triton.testing.do_bench(ref)
    print(
        f"{name:<14}{n_tok:>7}{ms_k * 1e3:>11.1f}{_gbps(n_bytes, ms_k):>9.0f}"
        f"{ms_r * 1e3:>11.1f}{_gbps(n_bytes, ms_r):>9.0f}{ms_r / ms_k:>8.2f}x"
    )


def bench(args: argparse.Namespace, n_tok: int) -> None:
    dev, dt = DEVICE, torch.bfloat16
    es = 2
    hidden, heads, kv_heads, d, ffn = (
        args.hidden,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.ffn,
    )
    x = torch.randn(n_tok, hidden, device=dev, dtype=dt)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device=dev)
    norm_bytes = 2 * x.numel() * es + hidden * 4
    _row(
        "rms_norm", n_tok, norm_bytes, lambda: rms_norm(x, w, EPS), lambda: rms_norm_ref(x, w, EPS)
    )
    _row(
        "add_rms_norm",
        n_tok,
        2 * norm_bytes,
        lambda: add_rms_norm(x, r, w, EPS),
        lambda: add_rms_norm_ref(x, r, w, EPS),
    )

    qkv = torch.randn(n_tok, (heads + 2 * kv_heads) * d, device=dev, dtype=dt)
    q = qkv[:, : heads * d].view(n_tok, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n_tok, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(n_tok, kv_heads, d)
    wq = torch.randn(d, device=dev)
    _row(
        "qk_norm(q)",
        n_tok,
        2 * q.numel() * es + d * 4,
        lambda: rms_norm(q, wq, EPS),
        lambda: rms_norm_ref(q, wq, EPS),
    )

    block_size = 16
    num_blocks = 2 * triton.cdiv(n_tok, block_size)
    fp8 = args.kv_dtype == "fp8"
    cache_dt = torch.float8_e4m3fn if fp8 else dt
    caches = [
        torch.zeros(num_blocks, block_size, kv_heads, d, device=dev).to(cache_dt) for _ in range(2)
    ]
    scales = [torch.ones(num_blocks, block_size, kv_heads, device=dev) for _ in range(2)]
    scales = scales if fp8 else [None, None]
    slots = torch.randperm(num_blocks * block_size, device=dev)[:n_tok]
    positions = torch.arange(n_tok, device=dev) + 1000
    rope_args = (positions, *caches, slots, d, 5e5, True, 1.0, None, *scales)
    cache_es = 1 if fp8 else es
    rope_bytes = qkv.numel() * es + q.numel() * es + 2 * k.numel() * cache_es + 16 * n_tok
    rope_bytes += 2 * n_tok * kv_heads * 4 if fp8 else 0
    _row(
        f"rope_kv({args.kv_dtype})",
        n_tok,
        rope_bytes,
        lambda: rope_and_write_kv(q, k, v, *rope_args),
        lambda: rope_and_write_kv_ref(q, k, v, *rope_args),
    )

    gate_up = torch.randn(n_tok, 2 * ffn, device=dev, dtype=dt)
    gate, up = gate_up[:, :ffn], gate_up[:, ffn:]
    act_bytes = 3 * n_tok * ffn * es
    _row(
        "silu_mul", n_tok, act_bytes, lambda: silu_mul(gate_up), lambda: act_ref.silu_mul(gate, up)
    )
    _row(
        "gelu_mul", n_tok, act_bytes, lambda: gelu_mul(gate_up), lambda: act_ref.gelu_mul(gate, up)
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_fused needs a CUDA device", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}, bf16 activations")
    cols = [("kernel", 14), ("tokens", 7), ("triton us", 11), ("GB/s", 9), ("torch us", 11)]
    cols += [("GB/s", 9), ("speedup", 9)]
    print("".join(f"{c:<{n}}" if c == "kernel" else f"{c:>{n}}" for c, n in cols))
    for n_tok in args.tokens:
        bench(args, n_tok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
