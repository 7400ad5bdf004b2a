"""The paged attention kernel (including its native FP8 path, which the interpreter cannot run)
and every packed quantized-matmul kernel compile for Hopper (sm_90) on a machine without a GPU:
the GEMVs (plain, factored, int8 and int8 over row-interleaved planes), the decode-batch GEMMs
(float32-formed, int8 codes on the tensor cores and, for Q4_K and Q6_K, fp16-formed weights)
and the dequantizing pass, for every packed type; and the RMSNorm that rounds its row to int8.
A kernel that the interpreter runs but the GPU compiler refuses (a Triton global that is not a
constexpr, an unsupported cast) fails here instead of on the lent device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_packed_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real compiles
    done = subprocess.run(
        [sys.executable, "-m", "tools.kernel_sass", "--check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # paged attention (bf16 / FP8 cache with per-token / FP8 with per-head scales x decode at batch
    # 16 and 1 / prefill / prefill with the split count read on the device), 10 types x 15 packed
    # variants (three over row-interleaved planes; three are the weights-first GEMM's), the int8
    # GEMVs of the 8 types that have them (per-thread rows, the one-tile variant, with the rounding
    # in its prologue, and the GEMV over interleaved planes with and without it, gated with its
    # outputs rounded for the next GEMV, with each of the three cache hints, CACHE 1-3, with RoPE
    # and the KV write in its epilogue (qkv_rope), and over 2 and 4 activation rows) and their
    # int8 tensor-core GEMM (both layouts), and the fp16 GEMM
    # (plain, gated, its activation conversion) of Q4_K and Q6_K; the fused add + RMSNorm rounding
    # its row to int8 for no, one or two layouts, and 4 rows for two (norm.add_rms_norm_int8);
    # RoPE + KV write into a bf16 cache and FP8 caches with per-token and per-head scales; two
    # rows GEMVs of two types in one launch (Q4_K + Q6_K, Q8_0 + Q4_K)
    assert done.stdout.count("compiled for sm_90") == 12 + 150 + 14 * 8 + 6 + 5 + 3 + 2
