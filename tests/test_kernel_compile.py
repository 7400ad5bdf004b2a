"""The paged attention kernel (including its native FP8 path, which the interpreter cannot run)
and every packed quantized-matmul kernel compile for Hopper (sm_90) on a machine without a GPU:
the GEMVs (plain, factored, int8 and int8 over row-interleaved planes), the decode-batch GEMMs
(float32-formed and, for Q4_K and Q6_K, fp16-formed weights) and the dequantizing pass, for
every packed type; the RMSNorm that rounds its row to int8; and
the greedy argmax.
A kernel that the interpreter runs but the GPU compiler refuses (a Triton global that is not a
constexpr, an unsupported cast) fails here instead of on the lent device."""

from __future__ import annotations

import json
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
    # variants (three over row-interleaved planes; three are the weights-first GEMM's), 11 int8
    # GEMVs of each of the 8 types that have them (per-thread rows, the one-tile variant, with
    # the rounding in its prologue, and the GEMV over interleaved planes with and without it,
    # gated with its outputs rounded for the next GEMV, with RoPE and the KV write in its
    # epilogue (qkv_rope), with the residual add and RMSNorm in its epilogue and with its
    # activations awaiting that norm's scale (norm_ahead), and over 2 and 4 activation rows),
    # and the fp16 GEMM (plain, gated, its activation conversion) of Q4_K and Q6_K; the fused
    # add + RMSNorm rounding its row to int8 for no, one or two layouts, and 4 rows for two
    # (norm.add_rms_norm_int8); RoPE + KV write into a bf16 cache and FP8 caches with per-token
    # and per-head scales; two rows GEMVs of two types in one launch (Q4_K + Q6_K, Q8_0 + Q4_K);
    # the greedy argmax (one counted launch, with its picks stored to the host too and without)
    # and the ids' copy to the host; a graph step's staging, with and without tokens in flight
    assert done.stdout.count("compiled for sm_90") == 12 + 150 + 11 * 8 + 6 + 5 + 3 + 2 + 2 + 1 + 2


_LATE_NEXT = """
import json
from gguf import GGMLQuantizationType as T
from tools.compile_launches import compile_pair
from tools.kernel_sass import compile_kernel

def places(ptx):
    lines = ptx.splitlines()
    at = lambda key: [i for i, line in enumerate(lines) if key in line]
    return {"next": at("griddepcontrol.launch_dependents"), "wait": at("griddepcontrol.wait"),
            "weights": at("L1::evict_first")}

out = {}
for late in (False, True):  # the RoPE epilogue: late for Q4_K and Q4_K + Q6_K (LATE_NEXT_ROPE)
    rows = compile_kernel("gemv-r8r" if late else "gemv-r8", T.Q4_K)
    out[f"rope-{late}"] = places(rows.asm["ptx"])
    out[f"pair-{late}"] = places(compile_pair((T.Q4_K, T.Q6_K), rope=late).asm["ptx"])
print(json.dumps(out))
"""


def test_late_next_moves_the_dependents_launch_after_the_weight_loop() -> None:
    """``packed_int8_rows_policy.late_next``: the Q4_K rows GEMV and the Q4_K + Q6_K pair
    launch let the next kernel's programs be placed first thing, and with the RoPE epilogue
    (the Q/K/V launches, ``LATE_NEXT_ROPE``) only after their weight loads (sm_90 PTX), still
    once a program."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real compiles
    done = subprocess.run(
        [sys.executable, "-c", _LATE_NEXT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    places = json.loads(done.stdout.splitlines()[-1])
    for kind in ("rope", "pair"):
        early, late = places[f"{kind}-False"], places[f"{kind}-True"]
        assert early["weights"] and len(early["weights"]) == len(late["weights"])
        assert len(early["next"]) == 1 and early["next"][0] < early["wait"][0]
        assert early["next"][0] < early["weights"][0]
        # the pair: a branch each weight, each with its wait and then its launch_dependents;
        # every weight load comes before the launch_dependents of its branch
        assert len(late["next"]) == len(late["wait"]) == (2 if kind == "pair" else 1)
        assert all(w < n for w, n in zip(late["wait"], late["next"], strict=True))
        bounds = [-1, *late["next"]]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            assert any(lo < w < hi for w in late["weights"])
        assert max(late["weights"]) < late["next"][-1]
