"""Split-K of the Triton paged attention: the split result equals a single pass (also with more
slices than key tiles), and the automatic split count for decode batches follows the H200's
measured rule (shared.kernels.paged_attention.default_num_splits). Helpers and the interpreter /
GPU selection: tests/test_kernel_paged_attention.py."""

from __future__ import annotations

import pytest

from tests.test_kernel_paged_attention import (
    F32,
    TOL,
    assert_close,
    make_batch,
    pa,
    reference,
    run_kernel,
    scenario,
    small_tiles,  # noqa: F401 - the fixture (usefixtures)
)


@pytest.mark.usefixtures("small_tiles")
def test_split_k_matches_single_pass() -> None:
    batch = make_batch(*scenario("mixed"), n_heads=4, n_kv_heads=1, head_dim=64, block_size=8)
    one = run_kernel(batch, 0.125, num_splits=1)
    for splits in (2, 5, 16):  # 16: more slices than some sequences have key tiles
        many = run_kernel(batch, 0.125, num_splits=splits)
        assert ((many - one).norm() / one.norm()).item() < 1e-6


def test_auto_split_for_long_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[int] = []

    def spy(*args: int) -> int:
        chosen.append(default(*args))
        return chosen[-1]

    default = pa.default_num_splits
    monkeypatch.setattr(pa, "default_num_splits", spy)
    monkeypatch.setattr(pa, "_num_sms", lambda device: 16)
    decode = make_batch([1, 1], [70, 33], n_heads=4, n_kv_heads=1, head_dim=64)
    out = run_kernel(decode, 0.125, max_seq_len=16384)  # a 16k-key hint: worth splitting
    assert chosen == [16]
    assert_close(out, reference(decode, 0.125), TOL[F32])
    run_kernel(decode, 0.125, max_seq_len=100)  # under two key tiles: no split
    assert chosen[-1] == 1
    prefill = make_batch([3, 1], [70, 33], n_heads=4, n_kv_heads=1, head_dim=64)
    run_kernel(prefill, 0.125, max_seq_len=4096)  # not a decode batch: no heuristic
    assert len(chosen) == 2


def test_default_num_splits() -> None:
    assert pa.default_num_splits(1, 8, 32768, 132) == 16  # capped
    assert pa.default_num_splits(16, 8, 8192, 132) == 3  # 128 programs -> 384
    assert pa.default_num_splits(64, 8, 4096, 132) == 1  # 512 programs fill the GPU already
    assert pa.default_num_splits(16, 8, 1024, 132) == 1  # measured: splitting 1k lost 2x
    # batches of under num_sms / 2 programs: the H200's graph-replayed best at 512-4096 keys
    assert pa.default_num_splits(1, 8, 656, 132) == 10  # one 64-key tile a slice
    assert pa.default_num_splits(2, 8, 4096, 132) == 16
    assert pa.default_num_splits(4, 8, 4096, 132) == 8
    assert pa.default_num_splits(8, 8, 34000, 132) == 4
    assert pa.default_num_splits(1, 8, 100, 132) == 1
