"""The paged attention kernel's wrapper rejects bad arguments with a message naming the problem
(the kernel itself is checked against the references in tests/test_kernel_paged_attention.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "the Triton kernel needs a CUDA device or TRITON_INTERPRET=1 (CPU interpreter)",
        allow_module_level=True,
    )

import shared.kernels.paged_attention as pa  # noqa: E402
from shared.ops.paged_attention_fp8 import FP8  # noqa: E402
from tests.test_kernel_paged_attention import Batch, make_batch  # noqa: E402


def _bad_call(batch: Batch, **override) -> None:
    i32 = {"dtype": torch.int32, "device": batch.q.device}
    args = {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": batch.block_tables,
        "query_start_loc": torch.tensor(batch.query_start_loc, **i32),
        "seq_lens": torch.tensor(batch.seq_lens, **i32),
        "scale": 0.125,
        "max_query_len": batch.max_query_len,
    }
    args.update(override)
    pa.paged_attention(**args)


@pytest.mark.parametrize(
    "override,message",
    [
        (lambda b: {"block_tables": b.block_tables.long()}, "block_tables must be"),
        (lambda b: {"q": b.q[:, :3]}, "not a multiple of n_kv_heads"),
        (lambda b: {"q": b.q[..., :32]}, "head_dim"),
        (lambda b: {"q": b.q.transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        (lambda b: {"k_cache": b.k_cache.half()}, "cache dtypes"),
        (lambda b: {"k_cache": b.k_cache[:, :12], "v_cache": b.v_cache[:, :12]}, "power of two"),
        (lambda b: {"query_start_loc": torch.zeros(2, dtype=torch.int32)}, "query_start_loc"),
        (lambda b: {"seq_lens": torch.zeros(3, dtype=torch.int64)}, "seq_lens"),
        (lambda b: {"k_scale": torch.ones(b.k_cache.shape[:3])}, "k_scale/v_scale given"),
        (lambda b: {"k_cache": b.k_cache.to(FP8), "v_cache": b.v_cache.to(FP8)}, "needs k_scale"),
        (lambda b: {"out": b.q.half()}, "out must be"),
        (lambda b: {"max_query_len": 99}, "max_query_len"),
        (lambda b: {"sliding_window": -1}, "sliding_window"),
    ],
)
def test_rejects_bad_arguments(override, message) -> None:
    batch = make_batch([2, 1, 1], [3, 0, 7], n_heads=4, n_kv_heads=2, head_dim=64)
    batch.k_cache = torch.nan_to_num(batch.k_cache)
    batch.v_cache = torch.nan_to_num(batch.v_cache)
    with pytest.raises(ValueError, match=message):
        _bad_call(batch, **override(batch))


def test_rejects_large_head_dim() -> None:
    batch = make_batch([1], [3], n_heads=1, n_kv_heads=1, head_dim=512)
    with pytest.raises(ValueError, match="head_dim 512 > 256"):
        _bad_call(batch)
